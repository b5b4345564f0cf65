"""The step: one optimizer step over the rows and scores (step), the rows and the teacher's scores
(collect), made ahead in a thread (pipeline), shared with tensor-parallel peers (share), the held-out evaluation
(evaluate)."""
