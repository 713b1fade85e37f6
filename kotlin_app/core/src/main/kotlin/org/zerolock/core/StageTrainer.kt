package org.zerolock.core

/** A violated stage rule; [code] is stable and mirrors the Python runtime's error names. */
class StageError(val code: String, message: String) : IllegalStateException("$code: $message")

/** Update windows of [size] micro-batches: window w = micro-batches [w*size, (w+1)*size). */
class UpdateWindows(val size: Int) {
    init { require(size >= 1) { "window size must be >= 1" } }
    fun windowOf(mb: Long): Long { require(mb >= 0); return mb / size }
    fun firstOf(window: Long): Long = window * size
    fun isLastOfWindow(mb: Long): Boolean = (mb + 1) % size == 0L
}

/**
 * The training half of a stage: gradient accumulation over update windows, AdamW at the end of
 * each window, then an atomic checkpoint, and exactly-once semantics across restarts.
 *
 * Rules:
 * - micro-batches are trained in order, starting at [nextMicroBatch] = (lastCommittedWindow+1)*W.
 * - gradients are accumulated over the window as a token-level mean ([WindowGradients],
 *   PROTOCOL.md 5.4.2; never persisted); after the window's last micro-batch: AdamW step,
 *   checkpoint (LoRA + m, v, step + window id) written durably, THEN the window is recorded as
 *   committed.
 * - a micro-batch whose window <= lastCommittedWindow is never applied again ([Outcome.SKIPPED]).
 * - if the checkpoint cannot be written, the in-memory update is rolled back to the last committed
 *   checkpoint, so the window is redone exactly once on replay.
 */
class StageTrainer(
    val windows: UpdateWindows,
    val optimizer: AdamW,
    private val store: CheckpointStoreApi,
    initialParams: Map<String, FloatArray>,
    /** A forward-only stage (LR 0 under ZeroLock, as zl_mobile's stage core): its windows commit with no
     *  gradient and no optimizer step, so its LoRA stays the init. */
    val forwardOnly: Boolean = false,
) {
    /** SKIPPED: an already committed window; WINDOW_COMPLETE: from [accumulate] only, commit next. */
    enum class Outcome { SKIPPED, ACCUMULATED, WINDOW_COMPLETE, COMMITTED }

    private val names: List<String> = initialParams.keys.toList()
    private val initial: Map<String, FloatArray> = initialParams.mapValues { it.value.copyOf() }
    private var params: LinkedHashMap<String, FloatArray> = LinkedHashMap()
    private var states: LinkedHashMap<String, AdamWState> = LinkedHashMap()
    private val accum = WindowGradients(initialParams.mapValues { it.value.size })

    var lastCommittedWindow: Long = -1
        private set
    var nextMicroBatch: Long = 0
        private set
    var optimizerSteps: Long = 0
        private set
    /** The window whose last micro-batch was accumulated but which is not committed yet. */
    var pendingWindow: Long? = null
        private set

    init { restore() }

    /** (Re)load the last committed checkpoint, or the initial LoRA if none was committed yet. */
    fun restore() {
        val ck = store.load()
        params = LinkedHashMap()
        states = LinkedHashMap()
        if (ck == null) {
            for (n in names) { params[n] = initial[n]!!.copyOf(); states[n] = AdamWState(initial[n]!!.size) }
            lastCommittedWindow = -1
            optimizerSteps = 0
        } else {
            if (ck.tensors.keys.toList() != names) {
                throw StageError("checkpoint_mismatch", "checkpoint tensors ${ck.tensors.keys} != $names")
            }
            for ((n, t) in ck.tensors) {
                if (t.param.size != initial[n]!!.size) throw StageError("checkpoint_mismatch", "tensor $n has ${t.param.size} values, expected ${initial[n]!!.size}")
                params[n] = t.param.copyOf()
                states[n] = AdamWState(t.param.size).also { s ->
                    t.expAvg.copyInto(s.expAvg); t.expAvgSq.copyInto(s.expAvgSq); s.step = ck.optimizerSteps
                }
            }
            lastCommittedWindow = ck.lastCommittedWindow
            optimizerSteps = ck.optimizerSteps
        }
        accum.reset()
        pendingWindow = null
        nextMicroBatch = windows.firstOf(lastCommittedWindow + 1)
    }

    fun isTrainable(mb: Long): Boolean = windows.windowOf(mb) > lastCommittedWindow

    /** Current LoRA values (copies). */
    fun parameters(): Map<String, FloatArray> = params.mapValues { it.value.copyOf() }
    fun parameter(name: String): FloatArray = params[name]?.copyOf() ?: throw NoSuchElementException(name)
    fun optimizerState(name: String): AdamWState = states[name]?.copy() ?: throw NoSuchElementException(name)

    /**
     * Feed phase-2 gradients of micro-batch [mb] and, after the window's last micro-batch, step
     * and commit at once ([Outcome.COMMITTED]). The stage runtime uses [accumulate] and
     * [commitWindow] instead, to report the micro-batch before the window's step.
     */
    fun onGradients(mb: Long, grads: Map<String, FloatArray>, validPositions: Int): Outcome {
        val o = accumulate(mb, grads, validPositions)
        if (o != Outcome.WINDOW_COMPLETE) return o
        commitWindow()
        return Outcome.COMMITTED
    }

    /**
     * Add micro-batch [mb]'s gradients, those of its mean loss over its [validPositions] (n_i),
     * to its window. [Outcome.WINDOW_COMPLETE]: it was the window's last micro-batch, and
     * [commitWindow] must run before the next micro-batch.
     */
    fun accumulate(mb: Long, grads: Map<String, FloatArray>, validPositions: Int): Outcome {
        if (!isTrainable(mb)) return Outcome.SKIPPED
        pendingWindow?.let { throw StageError("window_not_committed", "window $it is complete but not committed; micro-batch $mb must wait") }
        if (mb != nextMicroBatch) {
            throw StageError("out_of_order", "expected micro-batch $nextMicroBatch, got $mb")
        }
        if (!forwardOnly) accum.add(grads, validPositions)
        nextMicroBatch = mb + 1
        if (!windows.isLastOfWindow(mb)) return Outcome.ACCUMULATED
        pendingWindow = windows.windowOf(mb)
        return Outcome.WINDOW_COMPLETE
    }

    /**
     * End the complete window: AdamW step, checkpoint written durably, THEN the window is
     * recorded as committed. Returns the committed window. If the checkpoint cannot be written,
     * the in-memory update is rolled back to the last committed checkpoint and the error rethrown.
     */
    fun commitWindow(): Long {
        val window = pendingWindow ?: throw StageError("no_complete_window", "no complete window to commit (next micro-batch $nextMicroBatch)")
        val stepped = if (forwardOnly) 0L else 1L
        if (!forwardOnly) {
            val grad = accum.mean()
            for (n in names) optimizer.step(params[n]!!, grad[n]!!, states[n]!!)
        }
        val ck = Checkpoint(
            lastCommittedWindow = window,
            optimizerSteps = optimizerSteps + stepped,
            tensors = LinkedHashMap<String, Checkpoint.Tensor>().also { m ->
                for (n in names) m[n] = Checkpoint.Tensor(params[n]!!, states[n]!!.expAvg, states[n]!!.expAvgSq)
            },
        )
        try {
            store.commit(ck)
        } catch (e: Throwable) {
            // Applied in memory but not durable: undo, so the replayed window applies it exactly once.
            restore()
            throw e
        }
        lastCommittedWindow = window
        optimizerSteps += stepped
        pendingWindow = null
        accum.reset()
        return window
    }
}
