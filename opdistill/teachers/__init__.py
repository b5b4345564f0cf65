"""Where teacher scores come from: ONE interface (``Teacher.score(rows, request) -> TeacherScores``), one class per
source, and ``build_teacher``, the one place that chooses (docs/architecture.md, docs/teacher_service.md).

    base.py         Rows, ScoreRequest, Teacher (score / submit / groups / close)
    local.py        LocalTeacher: the model in this process (score_teacher: chunked lm_head, scored positions only)
    sharded.py      ShardedTeacher: the model FSDP2-sharded over the data-parallel ranks
    vllm.py         VllmTeacher: a vLLM engine in this process (prompt log-probs)
    remote.py       RemoteTeacher: our teacher server's client (wire.py: the payload codec it shares with serve/)
    stock_vllm.py   StockVllmTeacher: a stock ``vllm serve`` endpoint
    pool.py         TeacherPool: several servers of one teacher (balanced, failover, probed back in)
    cache.py        CachedTeacher: answers from a teacher cache file (and the file format)
    routed.py       RoutedTeacher: several named teachers, rows routed by a field of the data
    build.py        build_teacher(config, context)
"""
from opdistill.teachers.base import Rows, ScoreRequest, Teacher, TeacherError
from opdistill.teachers.build import TeacherContext, Teachers, build_teacher
from opdistill.teachers.cache import CachedTeacher, TeacherCacheError, load_cache, save_cache
from opdistill.teachers.fingerprint import teacher_fingerprint, tokenizer_fingerprint
from opdistill.teachers.http import TeacherServiceError
from opdistill.teachers.local import LocalTeacher, score_teacher
from opdistill.teachers.pool import TeacherPool
from opdistill.teachers.remote import RemoteTeacher
from opdistill.teachers.routed import RoutedTeacher
from opdistill.teachers.sharded import ShardedTeacher
from opdistill.teachers.stock_vllm import StockVllmTeacher

__all__ = ["CachedTeacher", "LocalTeacher", "RemoteTeacher", "RoutedTeacher", "Rows", "ScoreRequest", "ShardedTeacher",
           "StockVllmTeacher", "Teacher", "TeacherCacheError", "TeacherContext", "TeacherError", "TeacherPool",
           "TeacherServiceError", "Teachers", "build_teacher", "load_cache", "save_cache", "score_teacher",
           "teacher_fingerprint", "tokenizer_fingerprint"]
