"""Prompt datasets and tasks with verifiers."""
from opdistill.data.prompts import DatasetTask, PromptSource, render_prompt
from opdistill.data.tasks import CARRY_ADD_CHARS, CarryAdditionTask, GsmSymbolicTask, Problem, Task, make_task

__all__ = ["CARRY_ADD_CHARS", "CarryAdditionTask", "DatasetTask", "GsmSymbolicTask", "Problem", "PromptSource",
           "Task", "make_task", "render_prompt"]
