"""ZeroLock's eager reference: the training the phones run, in plain PyTorch on one machine.

Readable first, fast second: what the exported programs and the stages compute, written out so a
reader (and a test) can follow one micro-batch from the embedding to each chunk's local loss

    loss_k = alpha_k * CE(p_k, y) + (1 - alpha_k) * KL(p_k || p_{k-1})

where p_k is chunk k's readout of its output h_k (readouts.py: the final norm, a lens, or a tail of
the model's own later layers) and p_{k-1} the previous chunk's, held fixed. trainer.py accumulates
and steps it as a stage does (zl_mobile.accumulate, zl_mobile.adamw); metrics.py reads every chunk
out on held-out rows and measures delta_k, how far each chunk's readout is from its local optimum.
bench/quality.py runs the quality study on it; tests use it as the oracle for the programs.
"""
