package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.AffineChunkRunner
import org.zerolock.core.device.DeviceInfo
import org.zerolock.core.device.DeviceServer
import org.zerolock.core.device.FileReceiver
import org.zerolock.core.device.RunnerFactory
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Tensor
import org.zerolock.core.protocol.hostHandshake
import java.io.ByteArrayInputStream
import java.io.File
import java.net.InetAddress
import java.net.ServerSocket
import java.net.Socket
import java.security.MessageDigest

/** Issue 31 on the Kotlin core: what a careless peer can make a long-lived device keep or do. */
class LongLivedTest {
    @Test
    fun `a body's buffer grows as it arrives and a large frame still decodes whole`() {
        val h = Tensor.ofFloats(FloatArray(300_000) { it.toFloat() }, 1, 300_000) // 1.2 MB: several doublings
        val frame = Frames.encode(Messages.hiddenState(3, 1, h))
        val m = FrameReader(ByteArrayInputStream(frame), Frames.DEFAULT_MAX_FRAME).read()
        assertEquals(299_999f, m.tensor("h").toFloatArray()[299_999])
        // a header declaring 200 MiB followed by 100 bytes: TRUNCATED, having held only what came
        val head = frame.copyOf(16)
        val big = 200L shl 20
        for (k in 0 until 4) head[8 + k] = ((big ushr (8 * k)) and 0xff).toByte()
        val crc = Frames.crc32(head, 0, 12)
        for (k in 0 until 4) head[12 + k] = ((crc ushr (8 * k)) and 0xff).toByte()
        val e = assertThrows<ProtocolException> {
            FrameReader(ByteArrayInputStream(head + ByteArray(100)), Frames.DEFAULT_MAX_FRAME).read()
        }
        assertEquals(ErrorCode.TRUNCATED, e.code)
        assertTrue(e.message!!.contains("100 of ${big + 4} bytes"), e.message)
    }

    @Test
    fun `a commit beyond what was sent is an error and prunes nothing`() {
        val l = OutboundLinkState<String>("up", windowSize = 2, replayHorizon = 8)
        for (mb in 0L until 4L) l.publish(mb, "h$mb")
        l.connected(); assertNull(l.onReplayRequest(0)); l.onCredit(2)
        assertEquals(listOf(0L, 1L), generateSequence { l.takeNext() }.map { it.first }.toList())
        assertEquals(LinkRules.commitBeyondSentMessage(1000, 2, 2, "up"), l.onCommitted(1000))
        assertEquals(listOf(0L, 1L, 2L, 3L), l.buffered())
        assertEquals(-1L, l.downstreamCommitted)
        assertNull(l.onCommitted(0)) // the honest one: exactly window 0 goes
        assertEquals(listOf(2L, 3L), l.buffered())
        // a restarted downstream that committed window 1 before: its REPLAY_REQUEST starts past it
        l.disconnected(); l.connected()
        assertNull(l.onReplayRequest(4))
        assertNull(l.onCommitted(1))
        assertEquals(emptyList<Long>(), l.buffered())
        // the host's feed holds nothing and is never refused
        val feed = OutboundLinkState<String>("feed", 2, 8, pruneOnCommit = false)
        assertNull(feed.onCommitted(50))
    }

    @Test
    fun `micro-batches a stage can never use are named`() {
        fun u(mb: Long, w: Long = mb / 2, total: Long? = null) = LinkRules.unusable(mb, w, next = 4, inflightDepth = 2, windowSize = 2, total = total)
        assertNull(u(4)); assertNull(u(7))
        assertEquals("this stage is past it (it needs 4 next)", u(3))
        assertTrue(u(8)!!.startsWith("beyond what the 2 credits allow"))
        assertTrue(u(1_000_000)!!.startsWith("beyond"))
        assertEquals("the run has 5 micro-batches", u(5, total = 5))
        assertEquals("labelled window 9, but window size 2 puts it in window 2", u(4, w = 9))
        assertEquals(1024L * 1024 + 65536 + 16 * 100, LinkRules.linkFrameLimit(100))
    }

    @Test
    fun `a NaN loss leaves telemetry as nonfinite instead of failing the record`() {
        val t = Telemetry(stage = 1, window = 0, step = 0, taskLoss = Double.NaN, consisLoss = 0.5, pssBytes = 1, tempC = null,
            activeS = 1.0, waitS = 0.0, loss = Double.POSITIVE_INFINITY, microBatch = 0)
        val m = Frames.decodeOne(Frames.encode(t.toMessage())) // encodes, and passes the TELEMETRY schema
        assertEquals(listOf("loss", "task_loss"), m.meta["nonfinite"])
        assertTrue("loss" !in m.meta && m.meta["consis_loss"] == 0.5)
    }

    @Test
    fun `a transfer times out from its last chunk, whatever else the session carries`(@TempDir root: File) {
        var now = 0L
        val rx = FileReceiver(File(root, "files"), File(root, "incoming"), 8, staleAfterMs = 1000, clockNs = { now })
        val data = ByteArray(2000) { it.toByte() }
        val sha = Handshake.hex(MessageDigest.getInstance("SHA-256").digest(data))
        fun chunk(off: Int) = Message(MsgType.FILE_CHUNK, linkedMapOf("transfer_id" to 1L, "offset" to off.toLong()),
            mapOf("data" to Tensor.ofBytes(data.copyOfRange(off, off + 1000))))
        rx.onMessage(Message(MsgType.FILE_BEGIN, linkedMapOf("transfer_id" to 1L, "name" to "slow.bin", "kind" to "other",
            "size" to 2000L, "sha256" to sha)))
        rx.onMessage(chunk(0))
        now += 1_500_000_000 // heartbeats only, for 1.5 s: the session calls sweep on each
        rx.sweep()
        rx.onMessage(chunk(1000))
        val end = rx.onMessage(Message(MsgType.FILE_END, linkedMapOf("transfer_id" to 1L)))!!
        assertEquals(false, end.bool("ok"))
        assertTrue(end.string("message").contains("no chunk for 1.0 s"), end.string("message"))
        assertTrue(!File(root, "files/slow.bin").exists())
    }

    private val token = Handshake.newToken()

    private fun server(dir: File) = DeviceServer(DeviceInfo("jvm-longlived", "test", 1L shl 30), token, File(dir, "files"),
        File(dir, "ck"), RunnerFactory { _, _ -> AffineChunkRunner() })

    private class Conn(port: Int) : AutoCloseable {
        val s = Socket(InetAddress.getLoopbackAddress(), port).also { it.soTimeout = 10_000 }
        val r = FrameReader(s.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
        val w = FrameWriter(s.getOutputStream().buffered())
        override fun close() = s.close()
    }

    private fun assign(rid: Long, runId: String, listenPort: Int, upstreamToken: String) = Message(MsgType.STAGE_ASSIGN, linkedMapOf(
        "request_id" to rid, "stage" to 0, "num_stages" to 1, "upstream" to "host", "downstream" to null,
        "program_sha256" to "0".repeat(64), "window_size" to 2, "inflight_depth" to 2, "replay_horizon" to 16,
        "run_id" to runId, "upstream_token" to upstreamToken, "listen_port" to listenPort.toLong(),
        "config" to mapOf("restart" to true)))

    private fun link(port: Int, token: String): Pair<Conn, Long> {
        var c: Conn
        val end = System.currentTimeMillis() + 10_000
        while (true) { // the slot of the link just refused is released as its thread ends: BUSY until then
            c = Conn(port)
            try { hostHandshake(c.r, c.w, token, "test-upstream"); break } catch (e: ProtocolException) {
                c.close()
                if (e.code != ErrorCode.BUSY || System.currentTimeMillis() > end) throw e
                Thread.sleep(20)
            }
        }
        c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
        val first = c.r.read()
        assertEquals(MsgType.REPLAY_REQUEST, first.type)
        val credit = c.r.read()
        assertEquals(MsgType.CREDIT, credit.type)
        return c to credit.long("credits")
    }

    @Test
    fun `a fixed listen_port is bound again, an unbindable one is refused first, and the link keeps to its credits`(@TempDir dir: File) {
        val port = ServerSocket(0).use { it.localPort }
        val linkToken = Handshake.newToken()
        server(dir).use { srv ->
            Conn(srv.start(0, InetAddress.getLoopbackAddress())).use { c ->
                hostHandshake(c.r, c.w, token, "test-host")
                c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                for (i in 0 until 3) { // the host sends a USB phone the same listen_port every time
                    c.w.write(assign(i.toLong(), "fixed-$i", port, linkToken))
                    val ack = c.r.read()
                    assertEquals(MsgType.ACK, ack.type, ack.toString())
                    assertEquals(port.toLong(), ack.long("data_port"))
                }
                ServerSocket(0, 1, InetAddress.getLoopbackAddress()).use { holder ->
                    c.w.write(assign(9, "never-created", holder.localPort, Handshake.newToken()))
                    val e = c.r.read()
                    assertEquals(MsgType.ERROR, e.type, e.toString())
                    assertEquals("REJECTED", e.string("code"))
                    assertTrue(e.string("message").startsWith("STAGE_ASSIGN listen_port:"), e.string("message"))
                }
                // the running stage was not stopped: its link still answers, and keeps to its credits
                val (l, credits) = link(port, linkToken)
                l.use {
                    assertEquals(2L, credits)
                    l.w.write(Messages.hiddenState(1_000_000, 500_000, Tensor.ofFloats(FloatArray(6), 1, 2, 3)))
                    val refused = l.r.read()
                    assertEquals("UNEXPECTED", refused.string("code"))
                    assertTrue(refused.string("message").contains("not kept"), refused.string("message"))
                }
                val (l2, credits2) = link(port, linkToken)
                l2.use {
                    assertEquals(2L, credits2, "the refused frame was not queued")
                    for (mb in 1L..3L) l2.w.write(Messages.hiddenState(mb, mb / 2, Tensor.ofFloats(FloatArray(6), 1, 2, 3)))
                    val refused = l2.r.read()
                    assertEquals(LinkRules.noCreditMessage(3, "stage0-in"), refused.string("message"))
                }
                c.w.write(Message(MsgType.ERROR, linkedMapOf("code" to "INTERNAL", "message" to "about one request", "request_id" to 7L)))
                c.w.write(Messages.heartbeat(5, 0))
                var hb: Message
                do { hb = c.r.read() } while (hb.type != MsgType.HEARTBEAT || hb.long("seq") != 5L)
            }
        }
    }

    @Test
    fun `at the connection cap the oldest unauthenticated connection gives way to a host`(@TempDir dir: File) {
        server(dir).also { it.maxConnections = 2; it.handshakeTimeoutMs = 30_000 }.use { srv ->
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            val idle = (0 until 2).map { Socket(InetAddress.getLoopbackAddress(), port).also { s -> s.soTimeout = 5000 } }
            Thread.sleep(300) // both accepted and waiting for AUTH_REQUEST
            val t0 = System.currentTimeMillis()
            Conn(port).use { c -> assertEquals("jvm-longlived", hostHandshake(c.r, c.w, token, "test-host").string("name")) }
            assertTrue(System.currentTimeMillis() - t0 < 5000, "the host got in at once")
            val closed = idle.count { s ->
                s.soTimeout = 500
                try { s.getInputStream().read() == -1 } catch (_: java.net.SocketTimeoutException) { false }
            }
            assertEquals(1, closed, "one idle connection gave way, the other is still open")
            idle.forEach { it.close() }
        }
    }

    @Test
    fun `a host ERROR without request_id ends the session`(@TempDir dir: File) {
        server(dir).use { srv ->
            Conn(srv.start(0, InetAddress.getLoopbackAddress())).use { c ->
                hostHandshake(c.r, c.w, token, "test-host")
                c.w.write(Message(MsgType.ERROR, linkedMapOf("code" to "INTERNAL", "message" to "host gave up")))
                assertThrows<org.zerolock.core.protocol.ConnectionClosedException> { while (true) c.r.read() }
            }
        }
    }
}
