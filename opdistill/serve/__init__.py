"""The teacher server (``opdistill serve-teacher``): an ASGI app scoring rows with an in-process teacher.

Needs the ``serve`` extra (fastapi, uvicorn); the wire format and the client live in ``opdistill.engines.remote``.
"""
from opdistill.serve.app import LOOPBACK_HOSTS, ServeError, TeacherService, check_bind, create_app, score_rows, serve

__all__ = ["LOOPBACK_HOSTS", "ServeError", "TeacherService", "check_bind", "create_app", "score_rows", "serve"]
