"""Cross-tokenizer teachers (SPEC 6.6): a teacher whose tokenizer differs from the student's, mapped onto the
student's tokens through their bytes.

- :mod:`opdistill.xtok.tokens`: every token id of a tokenizer as the bytes it stands for (:class:`TokenBytes`), or a
  one-line refusal for a tokenizer that cannot say (no byte-level decode).
- :mod:`opdistill.xtok.bpm`: byte-prefix marginalisation: the teacher's next-token distributions along a response
  in its own tokenization -> a distribution over the student's next token, top-K plus a residual bucket
  (:func:`map_rows`), and the table it reads (:class:`VocabMap`).

The teacher that uses them is :class:`opdistill.teachers.xtok.CrossTokenizerTeacher` (it re-tokenizes the rows and
asks the teacher it wraps).
"""
from opdistill.xtok.bpm import MappedRows, RowText, VocabMap, map_rows
from opdistill.xtok.tokens import TokenBytes, TokenizerBytesError, check_chat_templates, token_bytes

__all__ = ["MappedRows", "RowText", "TokenBytes", "TokenizerBytesError", "VocabMap", "check_chat_templates", "map_rows",
           "token_bytes"]
