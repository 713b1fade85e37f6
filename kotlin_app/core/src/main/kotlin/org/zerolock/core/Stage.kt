package org.zerolock.core

import java.util.TreeMap

/** A violated stage rule; [code] is stable and mirrors the Python runtime's error names. */
class StageError(val code: String, message: String) : IllegalStateException("$code: $message")

/**
 * Stage k's inbound buffer of upstream hidden states h_{k-1}, keyed by micro-batch id.
 *
 * - bounded: at most [capacity] entries; pushing into a full buffer is an error (the upstream
 *   ignored its credits) -> [StageError] "buffer_full".
 * - entries are kept after processing: the buffer is this stage's replay source after a restart.
 * - the coordinator moves the replay horizon forward; entries with id < horizon are pruned, and a
 *   push below the horizon is dropped (returns false): nothing can ever replay it.
 * - pushing an id that is already buffered is an error ("duplicate_microbatch").
 */
class InboundBuffer<T>(val capacity: Int) {
    init { require(capacity >= 1) { "capacity must be >= 1" } }

    private val entries = TreeMap<Long, T>()

    /** Micro-batches with id < horizon are gone for good. Only moves forward. */
    var horizon: Long = 0
        private set

    val size: Int get() = entries.size
    val isFull: Boolean get() = entries.size >= capacity
    fun ids(): List<Long> = entries.keys.toList()
    operator fun contains(mb: Long): Boolean = entries.containsKey(mb)
    operator fun get(mb: Long): T? = entries[mb]

    /** Buffer h_{k-1} of micro-batch [mb]. Returns false when mb < horizon (stale, dropped). */
    fun push(mb: Long, entry: T): Boolean {
        require(mb >= 0) { "micro-batch id must be >= 0" }
        if (mb < horizon) return false
        if (entries.containsKey(mb)) throw StageError("duplicate_microbatch", "micro-batch $mb is already buffered")
        if (entries.size >= capacity) {
            throw StageError("buffer_full", "inbound buffer full ($capacity entries) at micro-batch $mb: sender ignored credits")
        }
        entries[mb] = entry
        return true
    }

    /** Set the replay horizon (coordinator) and prune every entry below it. Returns pruned count. */
    fun setHorizon(newHorizon: Long): Int {
        if (newHorizon < horizon) throw StageError("horizon_backwards", "replay horizon cannot move back ($horizon -> $newHorizon)")
        horizon = newHorizon
        val head = entries.headMap(newHorizon, false)
        val n = head.size
        head.clear()
        return n
    }

    /** Buffered entries with id >= [from], in id order: what a restarted stage replays. */
    fun replayFrom(from: Long): List<Pair<Long, T>> = entries.tailMap(from, true).map { it.key to it.value }
}

/**
 * Flow control towards the downstream neighbour: at most [depth] hidden-state frames in flight
 * (sent, not yet acknowledged by a credit). Each credit frame from downstream returns n credits.
 */
class CreditGate(val depth: Int) {
    init { require(depth >= 1) { "depth must be >= 1" } }

    var inFlight: Int = 0
        private set
    val available: Int get() = depth - inFlight
    fun canSend(): Boolean = inFlight < depth

    /** Account one hidden-state frame sent downstream; error if no credit is left. */
    fun onSend() {
        if (inFlight >= depth) throw StageError("no_credit", "$inFlight frames in flight, depth $depth")
        inFlight++
    }

    /** Downstream returned [n] credits. More credits than frames in flight is a protocol error. */
    fun onCredit(n: Int) {
        if (n < 1) throw StageError("bad_credit", "credit count must be >= 1, got $n")
        if (n > inFlight) throw StageError("credit_overflow", "$n credits returned but only $inFlight in flight")
        inFlight -= n
    }

    /** After a reconnect the neighbour starts from a clean slate. */
    fun reset() { inFlight = 0 }
}

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
 * - gradients are summed over the window (never persisted); after the window's last micro-batch:
 *   AdamW step, checkpoint (LoRA + m, v, step + window id) written durably, THEN the window is
 *   recorded as committed.
 * - a micro-batch whose window <= lastCommittedWindow is never applied again ([Outcome.SKIPPED]).
 * - if the checkpoint cannot be written, the in-memory update is rolled back to the last committed
 *   checkpoint, so the window is redone exactly once on replay.
 */
class StageTrainer(
    val windows: UpdateWindows,
    val optimizer: AdamW,
    private val store: CheckpointStoreApi,
    initialParams: Map<String, FloatArray>,
) {
    enum class Outcome { SKIPPED, ACCUMULATED, COMMITTED }

    private val names: List<String> = initialParams.keys.toList()
    private val initial: Map<String, FloatArray> = initialParams.mapValues { it.value.copyOf() }
    private var params: LinkedHashMap<String, FloatArray> = LinkedHashMap()
    private var states: LinkedHashMap<String, AdamWState> = LinkedHashMap()
    private var accum: LinkedHashMap<String, FloatArray> = LinkedHashMap()

    var lastCommittedWindow: Long = -1
        private set
    var nextMicroBatch: Long = 0
        private set
    var optimizerSteps: Long = 0
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
        resetAccumulators()
        nextMicroBatch = windows.firstOf(lastCommittedWindow + 1)
    }

    private fun resetAccumulators() {
        accum = LinkedHashMap()
        for (n in names) accum[n] = FloatArray(params[n]!!.size)
    }

    fun isTrainable(mb: Long): Boolean = windows.windowOf(mb) > lastCommittedWindow

    /** Current LoRA values (copies). */
    fun parameters(): Map<String, FloatArray> = params.mapValues { it.value.copyOf() }
    fun parameter(name: String): FloatArray = params[name]?.copyOf() ?: throw NoSuchElementException(name)
    fun optimizerState(name: String): AdamWState = states[name]?.copy() ?: throw NoSuchElementException(name)

    /** Feed phase-2 gradients of micro-batch [mb]. */
    fun onGradients(mb: Long, grads: Map<String, FloatArray>): Outcome {
        if (!isTrainable(mb)) return Outcome.SKIPPED
        if (mb != nextMicroBatch) {
            throw StageError("out_of_order", "expected micro-batch $nextMicroBatch, got $mb")
        }
        if (grads.keys != params.keys) throw StageError("bad_gradients", "gradient tensors ${grads.keys} != ${params.keys}")
        for ((n, g) in grads) {
            val a = accum[n]!!
            if (g.size != a.size) throw StageError("bad_gradients", "gradient $n has ${g.size} values, expected ${a.size}")
            for (i in a.indices) a[i] += g[i]
        }
        nextMicroBatch = mb + 1
        if (!windows.isLastOfWindow(mb)) return Outcome.ACCUMULATED

        val window = windows.windowOf(mb)
        for (n in names) optimizer.step(params[n]!!, accum[n]!!, states[n]!!)
        val ck = Checkpoint(
            lastCommittedWindow = window,
            optimizerSteps = optimizerSteps + 1,
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
        optimizerSteps += 1
        resetAccumulators()
        return Outcome.COMMITTED
    }
}
