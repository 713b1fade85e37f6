package org.zerolock.core

/**
 * One update window's gradient, the token-level mean of PROTOCOL.md 5.4.2, as
 * zl_mobile/accumulate.py: [add] takes the gradient of a micro-batch's mean loss over its
 * `nValid` valid positions and sums `nValid * g`; [mean] divides by the window's total (at
 * least 1, so a window without a valid position steps on zeros). Not the mean of micro-batch
 * means, which would weight a 1-position micro-batch like a 7-position one.
 */
class WindowGradients(private val sizes: Map<String, Int>) {
    private val sums = LinkedHashMap<String, FloatArray>()
    var positions: Long = 0
        private set

    init { reset() }

    fun reset() {
        for ((n, k) in sizes) sums[n] = FloatArray(k)
        positions = 0
    }

    /** Checks every tensor before adding any, so a bad call leaves the window as it was. */
    fun add(grads: Map<String, FloatArray>, nValid: Int) {
        if (nValid < 0) throw StageError("bad_gradients", "negative count of valid positions: $nValid")
        if (grads.keys != sums.keys) throw StageError("bad_gradients", "gradient tensors ${grads.keys} != ${sums.keys}")
        for ((n, g) in grads) if (g.size != sums[n]!!.size) throw StageError("bad_gradients", "gradient $n has ${g.size} values, expected ${sums[n]!!.size}")
        if (nValid > 0) { // a micro-batch without a valid position adds nothing (its gradient may be anything)
            val w = nValid.toFloat()
            // torch's add_(g, alpha=n) is one fused multiply-add per element: the same rounding
            for ((n, g) in grads) { val a = sums[n]!!; for (i in a.indices) a[i] = fma(w, g[i], a[i]) }
        }
        positions += nValid
    }

    /** The window's gradient: sum n_i g_i / max(sum n_i, 1), new arrays; the sums are kept. */
    fun mean(): Map<String, FloatArray> {
        val total = maxOf(positions, 1L).toFloat()
        return sums.mapValues { (_, a) -> FloatArray(a.size) { a[it] / total } }
    }
}
