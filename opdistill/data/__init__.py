"""Prompt datasets and tasks with verifiers."""
from opdistill.data.answers import extract_answer, match_answer
from opdistill.data.context import TeacherPrompt, question_of, reads_rows
from opdistill.data.prompts import (DatasetTask, PromptSource, prompt_text, render_prompt, render_prompts,
                                    split_held_out)
from opdistill.data.rewards import Rewards
from opdistill.data.tasks import (CARRY_ADD_CHARS, CarryAdditionTask, GsmSymbolicTask, LookupAdditionTask, MixedTask,
                                   Problem, ReasoningGymTask, Task, lookup_value, make_task)

__all__ = ["CARRY_ADD_CHARS", "CarryAdditionTask", "DatasetTask", "GsmSymbolicTask", "LookupAdditionTask",
           "MixedTask", "Problem", "lookup_value",
           "PromptSource", "ReasoningGymTask", "Rewards", "Task", "extract_answer", "make_task", "match_answer",
           "prompt_text", "render_prompt", "render_prompts", "split_held_out", "TeacherPrompt", "question_of",
           "reads_rows"]
