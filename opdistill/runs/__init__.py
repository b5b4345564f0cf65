"""Reading finished runs: a run directory's files (``files``), an evaluation's per-problem values and their summary
(``values``), bootstrap intervals and paired changes (``stats``), ``opdistill compare`` (``compare``) and
``opdistill plot`` (``plot``). The trainer writes what this package reads; nothing here trains or loads a model."""
