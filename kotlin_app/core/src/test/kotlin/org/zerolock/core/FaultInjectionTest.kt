package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.AppFailure
import org.zerolock.core.device.FailureSpec
import org.zerolock.core.device.FaultInjector
import java.io.File

/** The Kotlin core's injected failures (FaultInjector), as zl_mobile/stage_core.py's (the shared rules: StageCoreVectorsTest);
 *  the pipelines run them in tests/test_kotlin_phone.py. */
class FaultInjectionTest {
    private fun specs(vararg m: Map<String, Any?>) = FailureSpec.listOf(m.toList())

    @Test
    fun `a failure fires once per run, stage, window and point, across restarts`(@TempDir dir: File) {
        val logged = mutableListOf<String>()
        val s = specs(mapOf("window" to 2L, "point" to "before-commit", "mode" to "app", "detect" to "heartbeat"))
        val f = FaultInjector(s, dir, "r", 1) { logged += it }
        f.maybeFail("before-commit", 1) // another window
        f.maybeFail("after-phase1", 2) // another point
        val e = assertThrows<AppFailure> { f.maybeFail("before-commit", 2) }
        assertEquals("heartbeat", e.detect)
        assertEquals(listOf("stage 1: injected failure (app) at before-commit of window 2"), logged)
        FaultInjector(s, dir, "r", 1) {}.maybeFail("before-commit", 2) // the re-assigned stage replays it: no failure
        assertThrows<AppFailure> { FaultInjector(s, dir, "r2", 1) {}.maybeFail("before-commit", 2) } // another run's
    }

    @Test
    fun `defaults are zl_mobile's - after-phase1, process mode, connection`() {
        val s = FailureSpec.of(mapOf("window" to 3L))
        assertEquals(FailureSpec(3, "after-phase1", 0.0, "process", "connection"), s)
    }

    @Test
    fun `slow-phase1 slows the given window or every one, the stall holds a window once`(@TempDir dir: File) {
        val f = FaultInjector(specs(mapOf("window" to null, "point" to "slow-phase1", "seconds" to 0.25),
            mapOf("window" to 1L, "point" to "slow-phase1", "seconds" to 0.5),
            mapOf("window" to 1L, "point" to "hold-gil-in-phase1", "seconds" to 4.0)), dir, "r", 0) {}
        assertEquals(0.25, f.slowSeconds(0))
        assertEquals(0.75, f.slowSeconds(1))
        assertNull(f.stallSeconds(0))
        assertEquals(4.0, f.stallSeconds(1))
        assertNull(f.stallSeconds(1))
    }

    @Test
    fun `mid-checkpoint leaves a torn temp file that no restart reads`(@TempDir dir: File) {
        val file = File(dir, "ck.bin")
        val init = linkedMapOf("a" to floatArrayOf(0.5f, -1f), "b" to floatArrayOf(2f))
        val grads = mapOf("a" to floatArrayOf(0.1f, 0.2f), "b" to floatArrayOf(-0.3f))
        val faults = FaultInjector(specs(mapOf("window" to 1L, "point" to "mid-checkpoint", "mode" to "app")), dir, "r", 0) {}
        var torn: String? = null
        var window = 0L // the window being committed, as StageRuntime tracks it
        lateinit var store: FileCheckpointStore
        store = FileCheckpointStore(file) { p ->
            if (p == FileCheckpointStore.Point.AFTER_TEMP_SYNCED) {
                faults.maybeFail("mid-checkpoint", window) { store.tearPending().also { torn = it } }
            }
        }
        val t = StageTrainer(UpdateWindows(1), AdamW(lr = 1e-2), store, init)
        t.onGradients(0, grads, 1)
        val committed = file.readBytes()
        window = 1
        assertThrows<AppFailure> { t.onGradients(1, grads, 1) }
        assertTrue(torn!!.startsWith("left a half-written checkpoint ck.bin.tmp ("), torn)
        assertTrue(file.readBytes().contentEquals(committed), "the committed checkpoint is untouched")
        val r = StageTrainer(UpdateWindows(1), AdamW(lr = 1e-2), FileCheckpointStore(file), init)
        assertEquals(0, r.lastCommittedWindow)
        assertTrue(!File(dir, "ck.bin.tmp").exists())
    }
}
