package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.protocol.Tensor

/**
 * tests/vectors/window_gradient/window_gradient.json (PROTOCOL.md 5.4.2), generated from zl_mobile
 * (its make_vectors.py) and passed by tests/test_window_gradient_vectors.py too: the readout
 * gathering and its refusal, and the token-level window gradient.
 */
class WindowGradientVectorsTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/window_gradient/window_gradient.json").readText()).asObject()

    @Suppress("UNCHECKED_CAST")
    private fun cases(key: String) = (v[key] as List<Any?>).map { it.asObject() }

    @Suppress("UNCHECKED_CAST")
    private fun labels(c: Map<String, Any?>): Tensor {
        val rows = c["labels"] as List<List<Number>>
        return Tensor.ofLongs(rows.flatten().map { it.toLong() }.toLongArray(), rows.size.toLong(), rows[0].size.toLong())
    }

    @Suppress("UNCHECKED_CAST")
    private fun longs(x: Any?) = (x as List<Number>).map { it.toLong() }.toLongArray()

    @TestFactory
    fun `readout positions`(): List<DynamicTest> = cases("readout").map { c ->
        DynamicTest.dynamicTest(c.str("name")) {
            val cap = c.long("capacity").toInt()
            val mb = c.long("micro_batch")
            val batch = mapOf("h" to Tensor.ofFloats(FloatArray(1), 1, 1), "labels" to labels(c))
            val error = c["error"] as String?
            if (error != null) {
                val e = assertThrows<StageError> { LossBatch.of(mb, batch, cap) }
                assertEquals("loss_positions", e.code)
                assertEquals("loss_positions: $error", e.message, "zl_mobile's message")
                return@dynamicTest
            }
            val r = Readout.gather(labels(c).toLongArray(), cap, mb)
            assertArrayEquals(longs(c["index"]), r.index)
            assertArrayEquals(longs(c["target"]), r.target)
            assertArrayEquals(TestSupport.floats(c["weight"]), r.weight)
            assertEquals(c.long("valid").toInt(), r.valid)
            // what the program is fed: the HIDDEN_STATE tensors plus the three loss inputs
            val lb = LossBatch.of(mb, batch, cap)
            assertEquals(r.valid, lb.valid)
            assertEquals(setOf("h", "labels", "loss_index", "loss_target", "loss_weight"), lb.tensors.keys)
            assertArrayEquals(r.index, lb.tensors["loss_index"]!!.toLongArray())
            assertArrayEquals(longArrayOf(cap.toLong()), lb.tensors["loss_weight"]!!.shape)
            assertArrayEquals(r.weight, lb.tensors["loss_weight"]!!.toFloatArray())
        }
    }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `window gradient is the token-level mean`(): List<DynamicTest> = cases("windows").map { c ->
        DynamicTest.dynamicTest(c.str("name")) {
            val expected = c["expected"].asObject().mapValues { TestSupport.floats(it.value) }
            val mbs = (c["micro_batches"] as List<Any?>).map { it.asObject() }
            val acc = WindowGradients(expected.mapValues { it.value.size })
            val old = expected.mapValues { DoubleArray(it.value.size) }
            for ((i, m) in mbs.withIndex()) {
                val n = LossBatch.of(i.toLong(), mapOf("labels" to labels(m)), c.long("capacity").toInt()).valid
                assertEquals(m.long("n_valid").toInt(), n, "n_valid from the labels")
                val g = m["grads"].asObject().mapValues { TestSupport.floats(it.value) }
                acc.add(g, n)
                for ((k, a) in old) for (j in a.indices) a[j] += g[k]!![j].toDouble() / mbs.size
            }
            assertEquals(mbs.sumOf { it.long("n_valid") }, acc.positions)
            val got = acc.mean()
            var oldDiffers = false
            var bitwise = true
            for ((k, want) in expected) {
                for (j in want.indices) assertTrue(TestSupport.relClose(got[k]!![j], want[j], 1e-6), "$k[$j]: kotlin ${got[k]!![j]} python ${want[j]}")
                bitwise = bitwise && got[k]!!.contentEquals(want)
                oldDiffers = oldDiffers || want.indices.any { Math.abs(old[k]!![it] - want[it]) > 1e-3 }
            }
            val counts = mbs.map { it.long("n_valid") }.toSet()
            if (counts.size > 1) assertTrue(oldDiffers, "the mean of micro-batch means would pass this case too")
            println("window gradient ${c["name"]}: ${if (bitwise) "bit-identical to" else "within 1e-6 of"} zl_mobile")
        }
    }

    @Test
    fun `the trainer steps AdamW on the window's token-level mean`() {
        val c = cases("windows").first { it["name"] == "one_and_seven" }
        val expected = c["expected"].asObject().mapValues { TestSupport.floats(it.value) }
        @Suppress("UNCHECKED_CAST")
        val mbs = (c["micro_batches"] as List<Any?>).map { it.asObject() }
        val init = LinkedHashMap(expected.mapValues { FloatArray(it.value.size) { j -> 0.01f * j } })
        val t = StageTrainer(UpdateWindows(mbs.size), AdamW(lr = 1e-2), MemoryCheckpointStore(), init)
        for ((i, m) in mbs.withIndex()) t.accumulate(i.toLong(), m["grads"].asObject().mapValues { TestSupport.floats(it.value) }, m.long("n_valid").toInt())
        assertEquals(0L, t.commitWindow())
        for ((k, g) in expected) { // reference: one AdamW step on the vector's gradient
            val p = init[k]!!.copyOf(); val st = AdamWState(p.size)
            AdamW(lr = 1e-2).step(p, g, st)
            val mine = t.optimizerState(k)
            for (j in p.indices) {
                assertTrue(TestSupport.relClose(mine.expAvg[j], st.expAvg[j], 1e-6), "$k exp_avg[$j]: ${mine.expAvg[j]} vs ${st.expAvg[j]}")
                assertTrue(TestSupport.relClose(t.parameter(k)[j], p[j], 1e-6), "$k[$j]")
            }
        }
    }

    @Test
    fun `a bad call adds nothing, and labels must be integers`() {
        val acc = WindowGradients(mapOf("a" to 2, "b" to 1))
        acc.add(mapOf("a" to floatArrayOf(1f, 2f), "b" to floatArrayOf(3f)), 2)
        assertEquals("bad_gradients", assertThrows<StageError> { acc.add(mapOf("a" to floatArrayOf(9f, 9f), "b" to floatArrayOf(9f, 9f)), 1) }.code)
        assertEquals("bad_gradients", assertThrows<StageError> { acc.add(mapOf("a" to floatArrayOf(9f, 9f), "b" to floatArrayOf(9f)), -1) }.code)
        assertEquals(2L, acc.positions)
        assertArrayEquals(floatArrayOf(1f, 2f), acc.mean()["a"], "the failed calls left the sums alone")
        val f = mapOf("labels" to Tensor.ofFloats(floatArrayOf(1f), 1, 1))
        assertEquals("bad_labels", assertThrows<StageError> { LossBatch.of(0, f, 4) }.code)
        assertEquals("no_labels", assertThrows<StageError> { LossBatch.of(0, mapOf("h" to Tensor.ofFloats(FloatArray(2), 1, 2)), 4) }.code)
        // a chunk without readout rows (the stand-in): labels if any, else every row of h
        assertEquals(6, LossBatch.of(0, mapOf("h" to Tensor.ofFloats(FloatArray(24), 2, 3, 4)), null).valid)
        assertEquals(1, LossBatch.of(0, mapOf("h" to Tensor.ofFloats(FloatArray(24), 2, 3, 4),
            "labels" to Tensor.ofLongs(longArrayOf(-100, 4), 1, 2)), null).valid)
    }
}
