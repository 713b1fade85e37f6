"""What a run hands users: its adapter (PEFT, GGUF) checked against its base model, and merged models."""
