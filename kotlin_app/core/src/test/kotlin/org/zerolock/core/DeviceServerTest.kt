package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.AffineChunkRunner
import org.zerolock.core.device.DeviceInfo
import org.zerolock.core.device.DeviceServer
import org.zerolock.core.device.InboundLink
import org.zerolock.core.device.OutboundLink
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
import java.io.File
import java.net.InetAddress
import java.net.Socket
import java.security.MessageDigest

class DeviceServerTest {
    private val token = Handshake.newToken()

    private fun server(dir: File, ck: File = File(dir, "ck")) = DeviceServer(
        DeviceInfo("jvm-test", "test", 1L shl 30), token, File(dir, "files"), ck,
        RunnerFactory { _, _ -> AffineChunkRunner() },
    )

    private class Conn(port: Int) : AutoCloseable {
        val s = Socket(InetAddress.getLoopbackAddress(), port).also { it.soTimeout = 10_000 }
        val r = FrameReader(s.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
        val w = FrameWriter(s.getOutputStream().buffered())
        override fun close() = s.close()
    }

    private val feedToken = Handshake.newToken()
    private val outToken = Handshake.newToken()

    private fun assign(rid: Long, w: Int = 2, downstream: String? = null) = Message(MsgType.STAGE_ASSIGN, linkedMapOf(
        "request_id" to rid, "stage" to 0, "num_stages" to 1, "upstream" to "host", "downstream" to downstream,
        "program_sha256" to "0".repeat(64), "window_size" to w, "inflight_depth" to 2, "replay_horizon" to 16,
        "run_id" to "t", "upstream_token" to feedToken, "config" to mapOf("lr" to 0.05)).also {
            if (downstream != null) it["downstream_token"] = outToken
        })

    private fun input(mb: Long) = Tensor.ofFloats(FloatArray(6) { it + mb.toFloat() }, 1, 2, 3)
    private fun hidden(mb: Long, w: Int = 2) = Messages.hiddenState(mb, mb / w, input(mb))

    /** Read host-session messages until [done] holds; ERROR fails the test. */
    private fun collect(c: Conn, done: (Map<MsgType, List<Message>>) -> Boolean): Map<MsgType, List<Message>> {
        val got = HashMap<MsgType, MutableList<Message>>()
        while (!done(got)) {
            val m = c.r.read()
            assertTrue(m.type != MsgType.ERROR, m.toString())
            got.getOrPut(m.type) { mutableListOf() }.add(m)
        }
        return got
    }

    /** The `micro_batch` TELEMETRY records (the `window` ones are TELEMETRY too). */
    private fun microBatches(got: Map<MsgType, List<Message>>) = got[MsgType.TELEMETRY]?.filter { it.meta["kind"] == "micro_batch" } ?: emptyList()

    private fun commits(got: Map<MsgType, List<Message>>) = got[MsgType.CHECKPOINT_COMMITTED]?.map { it.long("window") } ?: emptyList()

    private fun waitFor(what: String, cond: () -> Boolean) {
        val end = System.currentTimeMillis() + 10_000
        while (!cond()) { assertTrue(System.currentTimeMillis() < end, "timed out waiting for $what"); Thread.sleep(10) }
    }

    @Test
    fun `session - handshake, assign, hidden states over the links, windows commit`(@TempDir dir: File) {
        val outQueue = InboundQueue<Message>()
        val collector = InboundLink("collector", outToken, outQueue, inflightDepth = 2, nextNeeded = { outQueue.nextAfter(0) },
            bind = InetAddress.getLoopbackAddress())
        server(dir).use { srv ->
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            Conn(port).use { c ->
                val hello = hostHandshake(c.r, c.w, token, "test-host")
                assertEquals("jvm-test", hello.string("name"))
                c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                // a second host is BUSY while this session holds the slot
                Conn(port).use { c2 ->
                    val e = assertThrows<ProtocolException> { hostHandshake(c2.r, c2.w, token, "intruder") }
                    assertEquals(ErrorCode.BUSY, e.code)
                }
                c.w.write(assign(1, downstream = "127.0.0.1:${collector.port}"))
                val ack = c.r.read()
                assertEquals(MsgType.ACK, ack.type, ack.toString()); assertTrue(ack.bool("ok"))
                assertEquals(-1L, ack.long("committed_window")); assertEquals(0L, ack.long("next_micro_batch"))
                // hidden states never travel on the host session
                c.w.write(hidden(0))
                val refused = c.r.read()
                assertEquals(MsgType.ERROR, refused.type); assertEquals("UNEXPECTED", refused.string("code"))
            }
            waitFor("the first session to end") { !srv.sessionBusy() }
            Conn(port).use { c ->
                hostHandshake(c.r, c.w, token, "test-host"); c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                c.w.write(assign(2, downstream = "127.0.0.1:${collector.port}")) // same run and stage: kept
                val ack = c.r.read()
                assertTrue(ack.bool("ok"), ack.toString())
                val feed = OutboundLink("host-feed", feedToken, windowSize = 2, replayHorizon = 16, pruneOnCommit = false)
                feed.setAddress("127.0.0.1:${ack.long("data_port")}")
                for (mb in 0L until 4L) feed.publish(hidden(mb))
                val out = (0L until 4L).map { mb ->
                    outQueue.take(mb, 10_000).also { collector.grant(1) } ?: throw AssertionError("no h_k for micro-batch $mb")
                }
                val got = collect(c) { commits(it).size >= 2 && microBatches(it).size >= 4 }
                val h0 = out[0].tensor("h")
                assertEquals(listOf(1L, 2L, 3L), h0.shape.toList())
                assertEquals(0.5f, h0.toFloatArray()[0]) // a=0, b=0.5 before the first update
                assertEquals(listOf(0L, 1L, 2L, 3L), out.map { it.long("micro_batch") })
                assertEquals(listOf(0L, 1L), commits(got))
                waitFor("the upstream to learn of the commits") { feed.downstreamCommitted == 1L }
                assertEquals(listOf(0L, 1L, 2L, 3L), feed.buffered(), "the host's feed keeps its inputs")
                val ck = File(dir, "ck").listFiles()!!.single { it.name.endsWith(".ckpt") }
                assertEquals(Handshake.hex(MessageDigest.getInstance("SHA-256").digest(ck.readBytes())), got[MsgType.CHECKPOINT_COMMITTED]!!.last().string("sha256"))
                c.w.write(Message(MsgType.STATE_GET, linkedMapOf("request_id" to 9, "kind" to "lora")))
                var st: Message
                do { st = c.r.read() } while (st.type != MsgType.STATE_PUT)
                assertEquals(setOf("a", "b"), st.tensors.keys)
                assertTrue(st.tensor("b").toFloatArray()[0] < 0.5f, "training moved b towards the target")
                c.w.write(Message(MsgType.SHUTDOWN, mapOf("reason" to "done")))
                feed.close()
            }
            // the slot is free again after the session ended
            waitFor("the session to end") { !srv.sessionBusy() }
            Conn(port).use { c -> hostHandshake(c.r, c.w, token, "test-host") }
        }
        collector.close()
    }

    @Test
    fun `a restarted device resumes after its last committed window and gets exactly its gap`(@TempDir dir: File) {
        val ck = File(dir, "ck")
        // the upstream stage's link: prunes on commit, replays from the downstream's resume point
        val up = OutboundLink("stage0-out", feedToken, windowSize = 2, replayHorizon = 16)
        server(File(dir, "a"), ck).use { srv ->
            Conn(srv.start(0, InetAddress.getLoopbackAddress())).use { c ->
                hostHandshake(c.r, c.w, token, "h"); c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                c.w.write(assign(1)); val ack = c.r.read()
                up.setAddress("127.0.0.1:${ack.long("data_port")}")
                for (mb in 0L until 5L) up.publish(hidden(mb))
                val got = collect(c) { microBatches(it).size >= 5 }
                assertEquals(listOf(0L, 1L), commits(got))
                waitFor("pruning on commit") { up.buffered() == listOf(4L) }
            }
        } // the device goes away with micro-batch 4 accumulated, not committed
        server(File(dir, "b"), ck).use { srv ->
            Conn(srv.start(0, InetAddress.getLoopbackAddress())).use { c ->
                hostHandshake(c.r, c.w, token, "h"); c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                c.w.write(assign(1)); val ack = c.r.read()
                assertEquals(1L, ack.long("committed_window")); assertEquals(4L, ack.long("next_micro_batch"))
                up.setAddress("127.0.0.1:${ack.long("data_port")}")
                for (mb in 5L until 8L) up.publish(hidden(mb))
                val got = collect(c) { commits(it).size >= 2 && microBatches(it).size >= 4 }
                assertEquals(listOf(2L, 3L), commits(got))
                assertEquals(listOf(4L, 5L, 6L, 7L), microBatches(got).map { it.long("micro_batch") }, "exactly the gap")
                c.w.write(Message(MsgType.STATE_GET, linkedMapOf("request_id" to 3, "kind" to "lora")))
                var st: Message
                do { st = c.r.read() } while (st.type != MsgType.STATE_PUT)
                assertEquals(4L, st.long("step"), "4 windows, each applied once")
                // reference: the same 8 micro-batches without a restart
                val runner = AffineChunkRunner()
                val ref = StageTrainer(UpdateWindows(2), AdamW(lr = 0.05, weightDecay = 0.0), MemoryCheckpointStore(), runner.initialLora())
                for (mb in 0L until 8L) {
                    val batch = LossBatch.of(mb, mapOf("h" to input(mb)), runner.readoutRows)
                    val lora = ref.parameters()
                    ref.onGradients(mb, runner.phase2(batch.tensors, runner.phase1(batch.tensors, lora), lora).grads, batch.valid)
                }
                for (n in listOf("a", "b")) assertArrayEquals(ref.parameter(n), st.tensor(n).toFloatArray(), n)
            }
        }
        up.close()
    }

    @Test
    fun `wrong token and messages before authentication are refused`(@TempDir dir: File) {
        server(dir).use { srv ->
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            Conn(port).use { c ->
                val e = assertThrows<ProtocolException> { hostHandshake(c.r, c.w, Handshake.newToken(), "bad") }
                assertEquals(ErrorCode.UNAUTHENTICATED, e.code)
            }
            Conn(port).use { c ->
                c.w.write(Messages.heartbeat(1))
                val m = c.r.read()
                assertEquals(MsgType.ERROR, m.type); assertEquals("UNAUTHENTICATED", m.string("code"))
            }
        }
    }

    @Test
    fun `file push lands atomically with a checked sha256`(@TempDir dir: File) {
        server(dir).use { srv ->
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            Conn(port).use { c ->
                hostHandshake(c.r, c.w, token, "h"); c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                val data = ByteArray(3000) { (it * 7).toByte() }
                val sha = Handshake.hex(MessageDigest.getInstance("SHA-256").digest(data))
                fun push(id: Long, sha256: String): Message {
                    c.w.write(Message(MsgType.FILE_BEGIN, linkedMapOf("transfer_id" to id, "name" to "chunk_0.pte", "kind" to "program", "size" to data.size, "sha256" to sha256)))
                    for (off in 0 until data.size step 1024) {
                        c.w.write(Message(MsgType.FILE_CHUNK, linkedMapOf("transfer_id" to id, "offset" to off), mapOf("data" to Tensor.ofBytes(data.copyOfRange(off, minOf(data.size, off + 1024))))))
                    }
                    c.w.write(Message(MsgType.FILE_END, linkedMapOf("transfer_id" to id)))
                    return c.r.read()
                }
                val bad = push(1, "f".repeat(64))
                assertEquals(false, bad.bool("ok")); assertEquals(sha, bad.string("sha256"))
                assertTrue(!File(dir, "files/chunk_0.pte").exists())
                val ok = push(2, sha)
                assertEquals(true, ok.bool("ok"), ok.toString())
                assertTrue(File(dir, "files/chunk_0.pte").readBytes().contentEquals(data))
            }
        }
    }

    /** Next host-session message that is not the device's own periodic heartbeat. */
    private fun reply(c: Conn): Message {
        while (true) { val m = c.r.read(); if (m.type != MsgType.HEARTBEAT) return m }
    }

    @Test
    fun `a bad STAGE_ASSIGN field is rejected by name and the session goes on`(@TempDir dir: File) {
        server(dir).use { srv ->
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            Conn(port).use { c ->
                hostHandshake(c.r, c.w, token, "h"); c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                for ((key, value, field) in listOf(Triple("run_id", "../../escape", "run_id"), Triple("run_id", "/tmp/escape_abs", "run_id"),
                        Triple("window_size", 1L shl 40, "window_size"), Triple("window_size", 0, "window_size"))) {
                    val m = assign(3)
                    val bad = Message(MsgType.STAGE_ASSIGN, LinkedHashMap(m.meta).also { it[key] = value })
                    c.w.write(bad)
                    val r = reply(c)
                    assertEquals(MsgType.ERROR, r.type, r.toString()); assertEquals("REJECTED", r.string("code"))
                    assertEquals(3L, r.long("request_id"))
                    assertTrue(r.string("message").startsWith("STAGE_ASSIGN $field:"), r.string("message"))
                }
                c.w.write(assign(4)) // the same session still takes a good one
                val ack = reply(c)
                assertTrue(ack.bool("ok"), ack.toString())
                c.w.write(Message(MsgType.SHUTDOWN, mapOf("reason" to "done")))
            }
            assertTrue(dir.parentFile.listFiles()!!.none { it.name.startsWith("escape") })
        }
    }

    @Test
    fun `a schedule or recovery this core cannot run is refused, not run as zerolock`(@TempDir dir: File) {
        server(dir).use { srv ->
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            Conn(port).use { c ->
                hostHandshake(c.r, c.w, token, "h"); c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                val base = assign(5).meta
                for ((change, words) in listOf(
                        mapOf<String, Any?>("schedule" to "gpipe") to "STAGE_ASSIGN schedule: ",
                        mapOf<String, Any?>("config" to mapOf("lr" to 0.05, "keep_checkpoints" to 7)) to "STAGE_ASSIGN config.keep_checkpoints: ",
                        mapOf<String, Any?>("config" to mapOf("lr" to 0.05, "restart" to true, "rollback_to_window" to 2)) to "STAGE_ASSIGN config.rollback_to_window: ",
                        // valid by the rules (up to 2^53), still not something this core runs: refused by field (5.3.1)
                        mapOf<String, Any?>("config" to mapOf("lr" to 0.05, "rollback_to_window" to (1L shl 53))) to "STAGE_ASSIGN config.rollback_to_window: ")) {
                    c.w.write(Message(MsgType.STAGE_ASSIGN, LinkedHashMap(base).also { it.putAll(change) }))
                    val r = reply(c)
                    assertEquals(MsgType.ERROR, r.type, r.toString()); assertEquals("REJECTED", r.string("code"))
                    assertEquals(5L, r.long("request_id"))
                    assertTrue(r.string("message").startsWith(words), r.string("message"))
                    assertTrue(listOf("global rollback", "runs only the zerolock schedule").any { it in r.string("message") }, r.string("message"))
                }
                c.w.write(Message(MsgType.STAGE_ASSIGN, LinkedHashMap(base).also { it["schedule"] = "zerolock"; it["request_id"] = 6 }))
                assertTrue(reply(c).bool("ok"))
                c.w.write(Message(MsgType.SHUTDOWN, mapOf("reason" to "done")))
            }
        }
    }

    /** PROTOCOL.md 5.1 / 5.6: an ERROR about one request carries its request_id and the session goes
     *  on; only one about no request ends it. A host's ERROR with a request_id is noted, not fatal. */
    @Test
    fun `an ERROR about one request carries its request_id and the session goes on`(@TempDir dir: File) {
        server(dir).use { srv ->
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            Conn(port).use { c ->
                hostHandshake(c.r, c.w, token, "h"); c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                fun alive(seq: Long) {
                    c.w.write(Messages.heartbeat(seq))
                    val hb = c.r.read() // this server sends no heartbeats of its own: this is the answer
                    assertEquals(MsgType.HEARTBEAT, hb.type, hb.toString()); assertEquals(seq, hb.long("seq"))
                }
                c.w.write(Message(MsgType.STATE_GET, linkedMapOf("kind" to "lora", "request_id" to 1L)))
                val e1 = reply(c)
                assertEquals(MsgType.ERROR, e1.type, e1.toString()); assertEquals("UNEXPECTED", e1.string("code"))
                assertEquals(1L, e1.meta["request_id"], e1.toString())
                alive(1)
                c.w.write(Messages.ack(77, true)) // a host's ACK answers nothing this device asked
                val e2 = reply(c)
                assertEquals(MsgType.ERROR, e2.type, e2.toString()); assertEquals(77L, e2.meta["request_id"], e2.toString())
                alive(2)
                c.w.write(Messages.error(ErrorCode.REJECTED, "about one request", 78)) // noted, unanswered
                alive(3)
                c.w.write(Messages.error(ErrorCode.INTERNAL, "the host gives up")) // about the session: it ends
                assertThrows<java.io.IOException> { reply(c) }
            }
            waitFor("the session to end") { !srv.sessionBusy() }
        }
    }

    @Test
    fun `a slowloris handshake times out however steadily it trickles`(@TempDir dir: File) {
        server(dir).use { srv ->
            srv.handshakeTimeoutMs = 1000
            val port = srv.start(0, InetAddress.getLoopbackAddress())
            val frame = Frames.encode(Message(MsgType.AUTH_REQUEST, linkedMapOf(
                "protocol_version" to 1, "host_nonce" to "ab".repeat(32), "host_name" to "slow")))
            Conn(port).use { c ->
                val out = c.s.getOutputStream()
                val trickle = Thread {
                    try { for (b in frame) { Thread.sleep(200); out.write(b.toInt()); out.flush() } } catch (_: Exception) {}
                }.also { it.isDaemon = true; it.start() }
                val err = c.r.read() // each byte resets a per-read timeout; the deadline is for the whole handshake
                assertEquals(MsgType.ERROR, err.type, err.toString()); assertEquals("TIMEOUT", err.string("code"))
                // one ERROR, then the close: the cut-off frame gets no TRUNCATED after it (PROTOCOL.md 2.2, 6)
                val after = try { c.r.read() } catch (e: java.io.IOException) { null }
                assertEquals(null, after, "after TIMEOUT the device sent $after")
                trickle.interrupt()
            }
            Conn(port).use { c -> hostHandshake(c.r, c.w, token, "after") } // still serving
        }
    }
}
