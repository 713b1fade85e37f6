"""A run on phones: its settings and options, its data, the coordinator and its sessions with the phones,
and what a run shows and writes as it goes (live view, TensorBoard, report, drift from the plan)."""
