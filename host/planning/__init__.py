"""Planning a run: phones profiled, the model split across them, and the schedule simulator that
predicts a pipeline's timeline."""
