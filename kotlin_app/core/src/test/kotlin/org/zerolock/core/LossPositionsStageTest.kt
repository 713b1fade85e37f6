package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.ChunkRunner
import org.zerolock.core.device.OutboundLink
import org.zerolock.core.device.Phase1Result
import org.zerolock.core.device.Phase2Result
import org.zerolock.core.device.StageAssignment
import org.zerolock.core.device.StageRuntime
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.Tensor
import java.io.File
import java.net.InetAddress
import java.util.Collections

/** PROTOCOL.md 5.4.2 in the running stage: the program gets the readout, AdamW the token-level mean, an overflow fails the stage. */
class LossPositionsStageTest {
    /** A program with 4 readout rows (and export.alpha [alpha]); records what each phase is fed; micro-batch k's gradient is fixed. */
    private class ReadoutRunner(override val alpha: Double? = null) : ChunkRunner {
        override val loraShapes = linkedMapOf("w" to longArrayOf(2))
        override val readoutRows = 4
        val fed: MutableList<Map<String, Tensor>> = Collections.synchronizedList(mutableListOf())
        val fed2: MutableList<Map<String, Tensor>> = Collections.synchronizedList(mutableListOf())
        override fun initialLora(): Map<String, FloatArray> = linkedMapOf("w" to floatArrayOf(0f, 0f))
        override fun phase1(batch: Map<String, Tensor>, lora: Map<String, FloatArray>): Phase1Result { fed += batch; return Phase1Result(batch["h"]!!, emptyMap()) }
        override fun phase2(batch: Map<String, Tensor>, p1: Phase1Result, lora: Map<String, FloatArray>): Phase2Result {
            fed2 += batch
            return Phase2Result(1.0, 1.0, 0.0, linkedMapOf("w" to grad(fed.size - 1)))
        }
        companion object { fun grad(mb: Int) = if (mb == 0) floatArrayOf(2f, -2f) else floatArrayOf(-3f, 0.5f) }
    }

    private fun waitFor(what: String, cond: () -> Boolean) {
        val end = System.currentTimeMillis() + 20_000
        while (!cond()) { assertTrue(System.currentTimeMillis() < end, "timed out waiting for $what"); Thread.sleep(10) }
    }

    @Test
    fun `the stage feeds the readout, steps on the token-level mean and fails a micro-batch it would have to cut`(@TempDir dir: File) {
        val feedToken = Handshake.newToken()
        val assign = StageAssignment(Message(MsgType.STAGE_ASSIGN, linkedMapOf(
            "request_id" to 1, "stage" to 0, "num_stages" to 1, "upstream" to "host", "program_sha256" to "0".repeat(64),
            "window_size" to 2, "inflight_depth" to 2, "replay_horizon" to 16, "run_id" to "lp", "upstream_token" to feedToken,
            "config" to mapOf("lr" to 0.05))))
        val runner = ReadoutRunner()
        val host = HostCapture()
        val rt = StageRuntime(assign, runner, File(dir, "ck"), { host.writer }, bind = InetAddress.getLoopbackAddress())
        val feed = OutboundLink("feed", feedToken, windowSize = 2, replayHorizon = 16, pruneOnCommit = false)
        val labels = listOf(
            longArrayOf(-100, -100, 7, -100, -100, -100),  // 1 valid
            longArrayOf(3, -100, 4, -100, -100, 5),        // 3 valid
            longArrayOf(1, 2, 3, 4, 5, -100),              // 5 valid: more than the 4 readout rows
        )
        try {
            feed.setAddress("127.0.0.1:${rt.dataPort}")
            for ((mb, l) in labels.withIndex()) {
                feed.publish(Messages.hiddenState(mb.toLong(), mb / 2L, Tensor.ofFloats(FloatArray(6), 1, 6, 1),
                    mapOf("labels" to Tensor.ofLongs(l, 1, 6))))
            }
            waitFor("the stage's ERROR") { host.messages().any { it.type == MsgType.ERROR } }
        } finally {
            feed.close()
            rt.stop()
        }
        // the program read micro-batch 0's one valid position from the readout rows
        assertArrayEquals(longArrayOf(2, 0, 0, 0), runner.fed[0]["loss_index"]!!.toLongArray())
        assertArrayEquals(longArrayOf(7, 0, 0, 0), runner.fed[0]["loss_target"]!!.toLongArray())
        assertArrayEquals(floatArrayOf(1f, 0f, 0f, 0f), runner.fed[0]["loss_weight"]!!.toFloatArray())
        assertArrayEquals(longArrayOf(0, 2, 5, 0), runner.fed[1]["loss_index"]!!.toLongArray())
        // window 0 stepped on (1 * g0 + 3 * g1) / 4, not (g0 + g1) / 2: AdamW's first moment is (1 - beta1) * g
        val g = FloatArray(2) { (1 * ReadoutRunner.grad(0)[it] + 3 * ReadoutRunner.grad(1)[it]) / 4 }
        val m = rt.trainer.optimizerState("w").expAvg
        for (i in g.indices) assertEquals(0.1 * g[i], m[i].toDouble(), 1e-6, "exp_avg[$i]")
        // micro-batch 2 is refused whole: no phase 1, no step, ERROR REJECTED fatal with zl_mobile's message
        assertEquals(2, runner.fed.size, "micro-batch 2 never reached the program")
        assertEquals(0L, rt.committedWindow)
        val msgs = host.messages()
        assertEquals(listOf(0L), msgs.filter { it.type == MsgType.CHECKPOINT_COMMITTED }.map { it.long("window") })
        val err = msgs.single { it.type == MsgType.ERROR }
        assertEquals("REJECTED", err.meta["code"]); assertEquals(true, err.meta["fatal"])
        assertTrue((err.meta["message"] as String).contains(
            "micro-batch 2 has 5 valid positions, more than the program's 4; re-export with zl-export --loss-positions 5 or more"), err.meta.toString())
        assertEquals("loss_positions", (rt.failure as StageError).code)
    }

    /** Runs [runner] as stage 0 with STAGE_ASSIGN [config] until phase 2 has run micro-batch 0. */
    private fun runOneMicroBatch(dir: File, config: Map<String, Any?>, runner: ReadoutRunner) {
        val feedToken = Handshake.newToken()
        val assign = StageAssignment(Message(MsgType.STAGE_ASSIGN, linkedMapOf(
            "request_id" to 1, "stage" to 0, "num_stages" to 1, "upstream" to "host", "program_sha256" to "0".repeat(64),
            "window_size" to 2, "inflight_depth" to 2, "replay_horizon" to 16, "run_id" to "alpha", "upstream_token" to feedToken,
            "config" to config)))
        val host = HostCapture()
        val rt = StageRuntime(assign, runner, File(dir, "ck"), { host.writer }, bind = InetAddress.getLoopbackAddress())
        val feed = OutboundLink("feed", feedToken, windowSize = 2, replayHorizon = 16, pruneOnCommit = false)
        try {
            feed.setAddress("127.0.0.1:${rt.dataPort}")
            feed.publish(Messages.hiddenState(0, 0, Tensor.ofFloats(FloatArray(6), 1, 6, 1),
                mapOf("labels" to Tensor.ofLongs(longArrayOf(-100, 1, -100, -100, -100, -100), 1, 6))))
            waitFor("phase 2 of micro-batch 0") { runner.fed2.isNotEmpty() }
        } finally {
            feed.close()
            rt.stop()
        }
        assertEquals(null, rt.failure)
    }

    private fun fedAlpha(batch: Map<String, Tensor>): Float {
        val t = batch["alpha"] ?: throw AssertionError("the program was not given alpha: ${batch.keys}")
        assertEquals(DType.FLOAT32, t.dtype)
        assertArrayEquals(longArrayOf(1), t.shape, "alpha is [1], as zl_mobile's Stage.alpha")
        return t.toFloatArray().single()
    }

    @Test
    fun `the program is given alpha from config, else from the export, in both phases`(@TempDir dir: File) {
        val overridden = ReadoutRunner(alpha = 0.25)
        runOneMicroBatch(File(dir, "a"), mapOf("lr" to 0.05, "alpha" to 0.8), overridden)
        assertEquals(0.8f, fedAlpha(overridden.fed[0]), "config.alpha overrides the export's")
        assertEquals(0.8f, fedAlpha(overridden.fed2[0]))

        for (config in listOf(mapOf("lr" to 0.05, "alpha" to null), mapOf("lr" to 0.05))) {
            val exported = ReadoutRunner(alpha = 0.25)
            runOneMicroBatch(File(dir, "b${config.size}"), config, exported)
            assertEquals(0.25f, fedAlpha(exported.fed[0]), "config $config: the manifest's export.alpha")
            assertEquals(0.25f, fedAlpha(exported.fed2[0]))
        }

        // neither given (a stand-in chunk without a local loss weight): no alpha input is made up
        val none = ReadoutRunner(alpha = null)
        runOneMicroBatch(File(dir, "c"), mapOf("lr" to 0.05), none)
        assertEquals(false, none.fed2[0].containsKey("alpha"))
    }
}
