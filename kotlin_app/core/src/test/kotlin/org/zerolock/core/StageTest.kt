package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import java.io.File

class StageTrainerTest {
    private val W = 3
    private fun initial() = linkedMapOf("q.lora_A" to floatArrayOf(0.1f, -0.2f, 0.3f), "v.lora_B" to floatArrayOf(0f, 0f))
    private fun grads(mb: Long): Map<String, FloatArray> {
        val r = java.util.Random(1000 + mb)
        return linkedMapOf("q.lora_A" to FloatArray(3) { r.nextGaussian().toFloat() }, "v.lora_B" to FloatArray(2) { r.nextGaussian().toFloat() })
    }
    /** n_valid of micro-batch mb: uneven, and 0 for some (they add nothing). */
    private fun n(mb: Long): Int = ((mb * 5) % 8).toInt()
    private fun opt() = AdamW(lr = 1e-2, weightDecay = 0.01)

    /** Reference: the same updates by hand, one AdamW step per window on its token-level mean
     *  ([WindowGradients], held to zl_mobile's by WindowGradientVectorsTest). */
    private fun reference(windows: Int): Map<String, FloatArray> {
        val p = initial()
        val st = p.mapValues { AdamWState(it.value.size) }
        val o = opt()
        for (w in 0 until windows) {
            val acc = WindowGradients(p.mapValues { it.value.size })
            for (mb in w * W until (w + 1) * W) acc.add(grads(mb.toLong()), n(mb.toLong()))
            val g = acc.mean()
            for (k in p.keys) o.step(p[k]!!, g[k]!!, st[k]!!)
        }
        return p
    }

    private fun assertParams(expected: Map<String, FloatArray>, t: StageTrainer) {
        for ((n, v) in expected) assertArrayEquals(v, t.parameter(n), "tensor $n")
    }

    @Test
    fun `accumulates over the window then steps and commits`(@TempDir dir: File) {
        val t = StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(File(dir, "ck.bin")), initial())
        assertEquals(0, t.nextMicroBatch)
        assertEquals(StageTrainer.Outcome.ACCUMULATED, t.onGradients(0, grads(0), n(0)))
        assertEquals(StageTrainer.Outcome.ACCUMULATED, t.onGradients(1, grads(1), n(1)))
        assertArrayEquals(initial()["q.lora_A"], t.parameter("q.lora_A"), "no update inside a window")
        assertEquals(StageTrainer.Outcome.COMMITTED, t.onGradients(2, grads(2), n(2)))
        assertEquals(0, t.lastCommittedWindow)
        assertEquals(1, t.optimizerSteps)
        assertParams(reference(1), t)
        assertEquals("out_of_order", assertThrows<StageError> { t.onGradients(4, grads(4), n(4)) }.code)
        assertEquals(StageTrainer.Outcome.SKIPPED, t.onGradients(1, grads(1), n(1)))
    }

    @Test
    fun `a forward-only trainer commits its windows without a step and keeps its LoRA the init`(@TempDir dir: File) {
        val store = FileCheckpointStore(File(dir, "ck.bin"))
        val t = StageTrainer(UpdateWindows(W), AdamW(lr = 0.0, weightDecay = 0.01), store, initial(), forwardOnly = true)
        for (mb in 0L until 2L * W) t.onGradients(mb, emptyMap(), n(mb)) // no gradient: phase 2 never ran
        assertEquals(1, t.lastCommittedWindow)
        assertEquals(0, t.optimizerSteps, "no optimizer step on a forward-only stage")
        assertParams(initial(), t)
        // a restart resumes after the committed windows, the LoRA still the init
        val again = StageTrainer(UpdateWindows(W), AdamW(lr = 0.0), store, initial(), forwardOnly = true)
        assertEquals(2L * W, again.nextMicroBatch)
        assertParams(initial(), again)
    }

    @Test
    fun `accumulate then commitWindow - the split the stage runtime uses to report before the step`(@TempDir dir: File) {
        val t = StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(File(dir, "ck.bin")), initial())
        assertEquals("no_complete_window", assertThrows<StageError> { t.commitWindow() }.code)
        assertEquals(StageTrainer.Outcome.ACCUMULATED, t.accumulate(0, grads(0), n(0)))
        assertEquals(StageTrainer.Outcome.ACCUMULATED, t.accumulate(1, grads(1), n(1)))
        assertEquals(StageTrainer.Outcome.WINDOW_COMPLETE, t.accumulate(2, grads(2), n(2)))
        // complete but not stepped: parameters, step count and committed window unchanged
        assertEquals(0L, t.pendingWindow); assertEquals(-1, t.lastCommittedWindow); assertEquals(0, t.optimizerSteps)
        assertArrayEquals(initial()["q.lora_A"], t.parameter("q.lora_A"))
        assertEquals("window_not_committed", assertThrows<StageError> { t.accumulate(3, grads(3), n(3)) }.code)
        assertEquals(0L, t.commitWindow())
        assertNull(t.pendingWindow); assertEquals(0, t.lastCommittedWindow); assertEquals(1, t.optimizerSteps)
        assertParams(reference(1), t)
        assertEquals("no_complete_window", assertThrows<StageError> { t.commitWindow() }.code)
        for (mb in 3L until 5L) assertEquals(StageTrainer.Outcome.ACCUMULATED, t.accumulate(mb, grads(mb), n(mb)))
        assertEquals(StageTrainer.Outcome.COMMITTED, t.onGradients(5, grads(5), n(5)))
        assertParams(reference(2), t)
    }

    @Test
    fun `restart resumes after the last committed window and never reapplies it`(@TempDir dir: File) {
        val f = File(dir, "ck.bin")
        val t = StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(f), initial())
        for (mb in 0L until 7L) t.onGradients(mb, grads(mb), n(mb)) // windows 0,1 committed; mb 6 accumulated
        // restart: accumulated grads of micro-batch 6 are lost on purpose (never persisted)
        val r = StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(f), initial())
        assertEquals(1, r.lastCommittedWindow)
        assertEquals(6, r.nextMicroBatch)
        assertParams(reference(2), r)
        assertEquals(r.optimizerState("q.lora_A").step, 2)
        for (mb in 0L until 6L) assertEquals(StageTrainer.Outcome.SKIPPED, r.onGradients(mb, grads(mb), n(mb)))
        for (mb in 6L until 9L) r.onGradients(mb, grads(mb), n(mb))
        assertParams(reference(3), r)
        assertParams(reference(3), StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(f), initial()))
    }

    private class Crash : RuntimeException("simulated crash")

    @Test
    fun `crash at each point of the commit applies the window exactly once`(@TempDir dir: File) {
        for (point in FileCheckpointStore.Point.values()) {
            val f = File(dir, "ck-$point.bin")
            var armed = false
            val crashing = FileCheckpointStore(f) { if (armed && it == point) throw Crash() }
            val t = StageTrainer(UpdateWindows(W), opt(), crashing, initial())
            for (mb in 0L until 3L) t.onGradients(mb, grads(mb), n(mb))
            armed = true
            t.onGradients(3, grads(3), n(3)); t.onGradients(4, grads(4), n(4))
            assertThrows<Crash> { t.onGradients(5, grads(5), n(5)) }
            // "process dies"; restart from disk
            val r = StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(f), initial())
            val committedOnDisk = point == FileCheckpointStore.Point.AFTER_RENAME
            assertEquals(if (committedOnDisk) 1 else 0, r.lastCommittedWindow, "point $point")
            assertFalse(File(dir, "ck-$point.bin.tmp").exists())
            for (mb in 0L until 9L) r.onGradients(mb, grads(mb), n(mb)) // the upstream replays; committed windows are SKIPPED
            assertEquals(2, r.lastCommittedWindow)
            assertEquals(3, r.optimizerSteps, "point $point: each window applied exactly once")
            assertParams(reference(3), r)
        }
    }

    @Test
    fun `a failed commit rolls the in-memory update back`(@TempDir dir: File) {
        var fail = false
        val store = FileCheckpointStore(File(dir, "ck.bin")) { if (fail && it == FileCheckpointStore.Point.AFTER_TEMP_SYNCED) throw java.io.IOException("disk full") }
        val t = StageTrainer(UpdateWindows(W), opt(), store, initial())
        for (mb in 0L until 3L) t.onGradients(mb, grads(mb), n(mb))
        fail = true
        t.onGradients(3, grads(3), n(3)); t.onGradients(4, grads(4), n(4))
        assertThrows<java.io.IOException> { t.onGradients(5, grads(5), n(5)) }
        assertEquals(0, t.lastCommittedWindow)
        assertEquals(3, t.nextMicroBatch)
        assertParams(reference(1), t)
        fail = false
        for (mb in 3L until 6L) t.onGradients(mb, grads(mb), n(mb))
        assertParams(reference(2), t)
        assertEquals(2, t.optimizerSteps)
    }

    @Test
    fun `checkpoint encoding round-trips and detects corruption`() {
        val ck = Checkpoint(4, 5, linkedMapOf("a" to Checkpoint.Tensor(floatArrayOf(1f, 2f), floatArrayOf(3f, 4f), floatArrayOf(5f, 6f))))
        val bytes = ck.encode()
        val back = Checkpoint.decode(bytes)
        assertEquals(4, back.lastCommittedWindow); assertEquals(5, back.optimizerSteps)
        assertArrayEquals(floatArrayOf(5f, 6f), back.tensors["a"]!!.expAvgSq)
        bytes[20] = (bytes[20].toInt() xor 1).toByte()
        assertThrows<java.io.IOException> { Checkpoint.decode(bytes) }
        assertEquals("checkpoint_mismatch", assertThrows<StageError> {
            val s = MemoryCheckpointStore(); s.commit(ck)
            StageTrainer(UpdateWindows(2), AdamW(), s, mapOf("b" to FloatArray(2)))
        }.code)
    }

    @Test
    fun `windows`() {
        val w = UpdateWindows(4)
        assertEquals(0, w.windowOf(3)); assertEquals(1, w.windowOf(4)); assertEquals(8, w.firstOf(2))
        assertTrue(w.isLastOfWindow(7)); assertFalse(w.isLastOfWindow(8))
    }
}
