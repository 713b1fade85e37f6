package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNotNull
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Assumptions.assumeTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.AffineChunkRunner
import org.zerolock.core.device.OutboundLink
import org.zerolock.core.device.StageAssignment
import org.zerolock.core.device.StageListener
import org.zerolock.core.device.StageRuntime
import org.zerolock.core.device.StatsProvider
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.Tensor
import java.io.File
import java.net.InetAddress
import java.util.Collections

/** The per-window TELEMETRY record (PROTOCOL.md 5.5, `kind` window), as zl_mobile/stage_core.py makes it (the shared
 *  figures: StageCoreVectorsTest). */
class WindowTelemetryTest {
    private fun counters(active: Double, wait: Double, seconds: Double, bytesIn: Long, bytesOut: Long) =
        TelemetryCounters(active, wait, seconds, bytesIn, bytesOut)

    @Test
    fun `means over the window, deltas since the previous window record, peak RSS over the window`() {
        val wt = WindowTelemetry(2, "zerolock", counters(1.0, 2.0, 100.0, 1000, 500))
        wt.add(0, 0.25, 0.5, loss = 3.0, taskLoss = 2.0, consisLoss = 1.0, rssPeakBytes = 100)
        wt.add(0, 0.75, 1.5, loss = 6.0, taskLoss = 4.0, consisLoss = 2.0, rssPeakBytes = 300)
        wt.add(0, 0.5, 1.0, loss = 9.0, taskLoss = 9.0, consisLoss = 0.0, rssPeakBytes = 200)
        wt.add(1, 9.0, 9.0, loss = 100.0, taskLoss = 100.0, consisLoss = 100.0, rssPeakBytes = 10_000) // another window: not mixed in
        val w0 = wt.close(0, step = 1, stepS = 0.125, now = counters(4.0, 2.5, 110.0, 1300, 900), pssBytes = 4242, tempC = 36.5, rssPeakNow = 250)!!
        assertEquals(Telemetry.WINDOW, w0.kind); assertTrue(w0.isWindow)
        assertEquals(2, w0.stage); assertEquals(0L, w0.window); assertEquals(1L, w0.step); assertEquals(3L, w0.microBatches)
        assertEquals(6.0, w0.loss!!, 1e-12); assertEquals(5.0, w0.taskLoss!!, 1e-12); assertEquals(1.0, w0.consisLoss!!, 1e-12)
        assertEquals(1.5, w0.phase1S!!, 1e-12); assertEquals(3.0, w0.phase2S!!, 1e-12); assertEquals(0.125, w0.stepS)
        assertEquals(3.0, w0.activeS, 1e-12); assertEquals(0.5, w0.waitS, 1e-12); assertEquals(10.0, w0.seconds!!, 1e-12)
        assertEquals(300L, w0.bytesIn); assertEquals(400L, w0.bytesOut)
        assertEquals(4242L, w0.pssBytes, "PSS now, not a mean"); assertEquals(36.5, w0.tempC)
        assertEquals(300L, w0.rssPeakBytes, "the highest micro-batch peak (higher than the reading at the close)")
        assertEquals("zerolock", w0.extra["schedule"])
        assertNull(w0.microBatch, "a window record names no micro-batch")

        wt.add(1, 1.0, 1.0, loss = 2.0, taskLoss = null, consisLoss = null, rssPeakBytes = null)
        val w1 = wt.close(1, step = 2, stepS = 0.5, now = counters(10.0, 3.0, 125.0, 1400, 950), pssBytes = 1, tempC = null, rssPeakNow = 20_000)!!
        // deltas count from the previous window record (not from the start)
        assertEquals(6.0, w1.activeS, 1e-12); assertEquals(0.5, w1.waitS, 1e-12); assertEquals(15.0, w1.seconds!!, 1e-12)
        assertEquals(100L, w1.bytesIn); assertEquals(50L, w1.bytesOut)
        assertEquals(2L, w1.microBatches); assertEquals(51.0, w1.loss!!, 1e-12)
        assertEquals(50.0, w1.taskLoss!!, 1e-12, "sum over the window / micro_batches, as zl_mobile")
        assertEquals(20_000L, w1.rssPeakBytes, "the reading at the close counts too")
        // on the wire: unavailable readings are left out
        val m = w1.toMap()
        assertEquals("window", m["kind"]); assertTrue("temperature_c" !in m)
        assertEquals(Telemetry.fromMessage(Frames.decodeOne(Frames.encode(w1.toMessage()))), w1)
    }

    @Test
    fun `no reading of the peak RSS leaves the key out, and an unknown window makes no record`() {
        val wt = WindowTelemetry(0, "zerolock", counters(0.0, 0.0, 0.0, 0, 0))
        assertNull(wt.close(0, 1, 0.1, counters(1.0, 1.0, 1.0, 1, 1), 1, null, 5))
        wt.add(0, 0.1, 0.1, 1.0, 1.0, 0.0, null)
        val w = wt.close(0, 1, 0.1, counters(2.0, 1.0, 3.0, 10, 0), 7, null, null)!!
        assertNull(w.rssPeakBytes); assertTrue("rss_peak_bytes" !in w.toMap())
        assertEquals(2.0, w.activeS, 1e-12, "the unknown window did not move the mark")
    }

    @Test
    fun `ProcStats reads VmHWM and PSS in bytes, resets the mark, and reports null where unavailable`(@TempDir dir: File) {
        File(dir, "status").writeText("Name:\tjava\nVmPeak:\t  999 kB\nVmHWM:\t    1234 kB\nVmRSS:\t  1000 kB\n")
        File(dir, "smaps_rollup").writeText("00400000-7fff [rollup]\nRss:   2000 kB\nPss:    1500 kB\n")
        File(dir, "clear_refs").writeText("")
        val p = ProcStats(dir)
        assertEquals(1234L * 1024, p.takePeakRssBytes())
        assertEquals("5", File(dir, "clear_refs").readText(), "the peak mark is reset (clear_refs 5)")
        assertEquals(1500L * 1024, p.pssBytes())
        val none = ProcStats(File(dir, "missing"))
        assertNull(none.takePeakRssBytes()); assertNull(none.pssBytes())
        File(dir, "status").writeText("VmHWM: lots kB\n")
        assertNull(p.takePeakRssBytes())
    }

    @Test
    fun `ProcStats splits out the PSS of mapped weights files and keeps the runtime's PSS from its first reading`(@TempDir dir: File) {
        File(dir, "smaps").writeText("""
            |55d0c0000000-55d0c0001000 r--p 00000000 fd:01 1234                       /system/bin/app_process64
            |Size:                  4 kB
            |Pss:                   3 kB
            |7f0000000000-7f0010000000 r--p 00000000 fd:01 99                         /data/user/0/org.zerolock/files/chunk_1.ptd
            |Size:             262144 kB
            |Rss:              100000 kB
            |Pss:               90000 kB
            |VmFlags: rd mr mw me
            |7f0010000000-7f0010100000 rw-p 00000000 00:00 0
            |Pss:                1000 kB
            |7f0020000000-7f0030000000 r--p 10000000 fd:01 99                         /data/user/0/org.zerolock/files/my weights.ptd (deleted)
            |Pss:                 500 kB
            |7f0030000000-7f0030001000 r--p 00000000 fd:01 98                         /data/user/0/org.zerolock/files/chunk_1.pte
            |Pss:                  40 kB
            |""".trimMargin())
        File(dir, "smaps_rollup").writeText("00400000-7fff [rollup]\nPss:    1500 kB\n")
        val p = ProcStats(dir)
        assertEquals((90000L + 500) * 1024, p.pssWeightsBytes(), "the .ptd mappings only (a path with spaces, a deleted file too)")
        assertEquals(1500L * 1024, p.runtimePssBytes())
        File(dir, "smaps_rollup").writeText("00400000-7fff [rollup]\nPss:    9999 kB\n")
        assertEquals(1500L * 1024, p.runtimePssBytes(), "read once: the PSS before the first program was loaded")
        assertEquals(9999L * 1024, p.pssBytes())
        File(dir, "smaps").writeText("7f0010000000-7f0010100000 rw-p 00000000 00:00 0\nPss:                1000 kB\n")
        assertEquals(0L, p.pssWeightsBytes(), "no weights file mapped")
        assertNull(ProcStats(File(dir, "missing")).pssWeightsBytes())
    }

    @Test
    fun `ProcStats on this Linux process`() {
        assumeTrue(File("/proc/self/status").readTextOrNull()?.contains("VmHWM:") == true, "no /proc/self/status with VmHWM here")
        val peak = ProcStats.SELF.takePeakRssBytes()
        assertNotNull(peak); assertTrue(peak!! > 0)
    }

    private fun File.readTextOrNull(): String? = try { readText() } catch (_: Exception) { null }

    // ---- the stage runtime: the records it sends, in order --------------------------------------

    /** Scripted readings: PSS = 1000 + n-th sample; peak RSS from [peaks] in call order. */
    private class ScriptedStats(private val peaks: List<Long?>) : StatsProvider {
        var samples = 0
        var peakCalls = 0
        var weightsReads = 0
        override fun sample(): Pair<Long, Double?> = Pair(1000L + samples++, null)
        override fun takePeakRssBytes(): Long? = peaks.getOrNull(peakCalls++)
        override fun runtimePssBytes(): Long? = 777L
        override fun weightsPssBytes(): Long? = 4096L * ++weightsReads
    }

    private fun assignment(feedToken: String, w: Int) = StageAssignment(Message(MsgType.STAGE_ASSIGN, linkedMapOf(
        "request_id" to 1, "stage" to 0, "num_stages" to 1, "upstream" to "host", "program_sha256" to "0".repeat(64),
        "window_size" to w, "inflight_depth" to 2, "replay_horizon" to 16, "run_id" to "wt", "upstream_token" to feedToken,
        "config" to mapOf("lr" to 0.05))))

    private fun waitFor(what: String, cond: () -> Boolean) {
        val end = System.currentTimeMillis() + 20_000
        while (!cond()) { assertTrue(System.currentTimeMillis() < end, "timed out waiting for $what"); Thread.sleep(10) }
    }

    @Test
    fun `the stage sends each window's record after its micro-batches and before its CHECKPOINT_COMMITTED`(@TempDir dir: File) {
        val W = 2
        val windows = 3
        val feedToken = Handshake.newToken()
        // calls: the stage's start (ignored), then per window: mb, mb, the close
        val stats = ScriptedStats(listOf(999_999L, 100L, 300L, 200L, 50L, 60L, 700L, 5L, null, null))
        val host = HostCapture()
        val heard = Collections.synchronizedList(mutableListOf<Telemetry>())
        val listener = object : StageListener {
            override fun onTelemetry(t: Telemetry) { heard += t }
            override fun onWindow(t: Telemetry) { heard += t }
        }
        val rt = StageRuntime(assignment(feedToken, W), AffineChunkRunner(), File(dir, "ck"), { host.writer }, stats, listener,
            InetAddress.getLoopbackAddress())
        val feed = OutboundLink("feed", feedToken, windowSize = W, replayHorizon = 16, pruneOnCommit = false)
        var fedBytes = 0L
        try {
            feed.setAddress("127.0.0.1:${rt.dataPort}")
            for (mb in 0L until (W * windows).toLong()) {
                val h = Tensor.ofFloats(FloatArray(6) { 0.1f * (it + 1) * (mb + 1) }, 1, 2, 3)
                fedBytes += h.data.size
                feed.publish(Messages.hiddenState(mb, mb / W, h))
            }
            waitFor("$windows commits") { host.messages().count { it.type == MsgType.CHECKPOINT_COMMITTED } >= windows }
        } finally {
            feed.close()
            rt.stop()
        }
        val msgs = host.messages()
        assertTrue(msgs.none { it.type == MsgType.ERROR }, msgs.toString())
        // the exact order: the window's micro-batch records, its window record, its commit
        val expected = (0 until windows).flatMap { w ->
            (0 until W).map { "mb ${w * W + it}" } + listOf("window $w", "commit $w")
        }
        val actual = msgs.map {
            when {
                it.type == MsgType.CHECKPOINT_COMMITTED -> "commit ${it.long("window")}"
                it.type == MsgType.TELEMETRY && it.meta["kind"] == "window" -> "window ${it.long("window")}"
                it.type == MsgType.TELEMETRY && it.meta["kind"] == "micro_batch" -> "mb ${it.long("micro_batch")}"
                else -> "${it.type} ${it.meta}"
            }
        }
        assertEquals(expected, actual)

        val records = msgs.filter { it.type == MsgType.TELEMETRY }.map { Telemetry.fromMessage(it) }
        assertEquals(records, heard.toList(), "the UI hears the same records, in the same order")
        val mbs = records.filter { it.kind == Telemetry.MICRO_BATCH }
        val wins = records.filter { it.isWindow }
        assertEquals(listOf(100L, 300L, 50L, 60L, 5L, null), mbs.map { it.rssPeakBytes }, "each micro-batch's own peak")
        assertEquals(listOf(300L, 700L, 5L), wins.map { it.rssPeakBytes }, "the window's peak: its micro-batches and the close, not the start")
        assertTrue(mbs.last().toMap().let { "rss_peak_bytes" !in it && "temperature_c" !in it }, "unavailable readings are left out")
        // PSS: the reading made when the record is made (samples 0,1 = mb 0,1; 2 = window 0; ...)
        assertEquals(listOf(1002L, 1005L, 1008L), wins.map { it.pssBytes })
        // the memory breakdown, as zl_mobile: the runtime's PSS, the weights' read once (after the first window)
        assertEquals(listOf(777L, 777L, 777L), wins.map { it.extra["pss_runtime_bytes"] })
        assertEquals(listOf(4096L, 4096L, 4096L), wins.map { it.extra["pss_weights_bytes"] })
        assertEquals(1, stats.weightsReads, "smaps is read once")
        assertTrue(mbs.none { "pss_weights_bytes" in it.toMap() }, "micro-batch records carry no breakdown")
        for (w in wins) {
            val mine = mbs.filter { it.window == w.window }
            assertEquals(W.toLong(), w.microBatches); assertEquals(W, mine.size)
            assertEquals(mine.map { it.loss!! }.average(), w.loss!!, 1e-12)
            assertEquals(mine.map { it.taskLoss!! }.average(), w.taskLoss!!, 1e-12)
            assertEquals(mine.map { it.consisLoss!! }.average(), w.consisLoss!!, 1e-12)
            assertEquals(mine.sumOf { it.num("phase1_end") - it.num("phase1_start") }, w.phase1S!!, 1e-9)
            assertEquals(mine.sumOf { it.num("phase2_end") - it.num("phase2_start") }, w.phase2S!!, 1e-9)
            assertEquals(w.window!! + 1, w.step, "the window's step")
            assertTrue(mine.all { it.step == w.window!! }, "micro-batch records come before the window's step")
            assertTrue(w.stepS!! > 0 && w.activeS >= w.phase1S!! + w.stepS!! - 1e-6 && w.activeS <= w.seconds!! + 1e-6, w.toString())
            assertEquals("zerolock", w.extra["schedule"])
        }
        // the window deltas add up to the running totals the micro-batch records carry
        assertEquals(fedBytes, wins.sumOf { it.bytesIn!! }); assertEquals(fedBytes, mbs.last().bytesIn)
        assertEquals(0L, wins.sumOf { it.bytesOut!! })
        assertEquals(mbs.last().waitS, wins.sumOf { it.waitS }, 1e-9)
        assertEquals(mbs.last().activeS + wins.last().stepS!!, wins.sumOf { it.activeS }, 1e-6)
        assertEquals(listOf(1L, 2L, 3L), msgs.filter { it.type == MsgType.CHECKPOINT_COMMITTED }.map { it.long("step") })
    }

    private fun Telemetry.num(k: String): Double = (extra[k] as Number).toDouble()
}
