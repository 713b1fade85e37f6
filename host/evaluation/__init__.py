"""zl-host eval's scoring: held-out loss and accuracy, generated answers, and their progress."""
