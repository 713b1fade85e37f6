package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.AffineChunkRunner
import org.zerolock.core.device.ManifestChunkRunner
import org.zerolock.core.device.MethodBackend
import org.zerolock.core.device.StageAssignment
import org.zerolock.core.device.StageRuntime
import org.zerolock.core.protocol.DeviceAuth
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
import org.zerolock.core.protocol.deviceHandshake
import org.zerolock.core.protocol.hostHandshake
import java.io.File
import java.io.OutputStream
import java.net.InetAddress
import java.net.ServerSocket
import java.net.Socket

/**
 * Issue 31: a stage bounds what a peer may declare in a frame on either of its links by what its
 * chunk's hidden state can need (zl_mobile's link_frame_limit of Stage._link_elements), not 256 MiB.
 */
class LinkFrameLimitTest {
    @Test
    fun `a manifest chunk's link elements are its data inputs and its output h, as zl_mobile counts them`() {
        val text = """{"lora": [{"name": "q.lora_A", "shape": [4, 64]}],
          "methods": {
            "phase1": {"inputs": [{"name": "q.lora_A", "shape": [4, 64]}, {"name": "h_in", "shape": [2, 16, 64]},
                                  {"name": "attention_mask", "shape": [2, 16]}, {"name": "position_ids", "shape": [2, 16]}],
                       "outputs": [{"name": "h_out", "shape": [2, 16, 64]}, {"name": "saved_0", "shape": [32, 64]}]},
            "phase2": {"inputs": [], "outputs": []}}}"""
        val none = object : MethodBackend { override fun run(method: String, inputs: List<Tensor>, outputNames: List<String>) = error("not run") }
        assertEquals(2048L + 32 + 32 + 2048, ManifestChunkRunner(Json.parse(text).asObject(), none).linkElements)
        // a manifest without the output's shape: unknown, the stage keeps the default limit
        val noShape = text.replace("""{"name": "h_out", "shape": [2, 16, 64]}""", """{"name": "h_out"}""")
        assertTrue(noShape != text)
        assertNull(ManifestChunkRunner(Json.parse(noShape).asObject(), none).linkElements)
    }

    private val elements = 100_000L // h in (50,000) and h out (50,000) of the test chunk
    private val limit = LinkRules.linkFrameLimit(elements)

    /** The 16 header bytes of a sealed HIDDEN_STATE frame declaring a body of [bodyLen] bytes (and no body). */
    private fun header(bodyLen: Long): ByteArray {
        val h = Frames.encode(Messages.hiddenState(0, 0, Tensor.ofFloats(FloatArray(1), 1))).copyOf(16)
        for (k in 0 until 4) h[8 + k] = ((bodyLen ushr (8 * k)) and 0xff).toByte()
        h[6] = Frames.SEALED_FLAG.toByte() // sent after the handshake: a sealed frame's header (PROTOCOL.md 6.1)
        val crc = Frames.crc32(h, 0, 12)
        for (k in 0 until 4) h[12 + k] = ((crc ushr (8 * k)) and 0xff).toByte()
        return h
    }

    private class Conn(val s: Socket) : AutoCloseable {
        init { s.soTimeout = 10_000 }
        val r = FrameReader(s.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
        val w = FrameWriter(s.getOutputStream().buffered())
        val raw: OutputStream = s.getOutputStream()
        override fun close() = s.close()

        /** The peer's ERROR for a frame it refused (past its CREDIT / commit frames), then the end of the link. */
        fun refusal(): Message {
            var e: Message
            do { e = r.read() } while (e.type == MsgType.CREDIT || e.type == MsgType.CHECKPOINT_COMMITTED)
            assertEquals(MsgType.ERROR, e.type, e.toString())
            assertThrows<Exception> { r.read() } // closed (EOF or reset)
            return e
        }
    }

    /** An authenticated upstream link to the stage's data port (BUSY while the last one's slot is freed). */
    private fun upstream(rt: StageRuntime, token: String): Conn {
        val end = System.currentTimeMillis() + 10_000
        while (true) {
            val c = Conn(Socket(InetAddress.getLoopbackAddress(), rt.dataPort))
            try {
                hostHandshake(c.r, c.w, token, "up")
                c.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                assertEquals(MsgType.REPLAY_REQUEST, c.r.read().type)
                return c
            } catch (x: ProtocolException) {
                c.close()
                assertTrue(x.code == ErrorCode.BUSY && System.currentTimeMillis() < end, x.toString())
                Thread.sleep(20)
            }
        }
    }

    private fun assignment(upToken: String, downToken: String, downstream: String) = StageAssignment(Message(MsgType.STAGE_ASSIGN, linkedMapOf(
        "request_id" to 1, "stage" to 0, "num_stages" to 2, "upstream" to "host", "downstream" to downstream,
        "program_sha256" to "0".repeat(64), "window_size" to 2, "inflight_depth" to 2, "replay_horizon" to 16,
        "run_id" to "limit", "upstream_token" to upToken, "downstream_token" to downToken)))

    @Test
    fun `both links of a stage refuse a frame declaring more than its chunk can need, and pass a real hidden state`(@TempDir dir: File) {
        val upToken = Handshake.newToken()
        val downToken = Handshake.newToken()
        ServerSocket(0, 4, InetAddress.getLoopbackAddress()).use { downServer ->
            downServer.soTimeout = 10_000
            val rt = StageRuntime(assignment(upToken, downToken, "127.0.0.1:${downServer.localPort}"),
                AffineChunkRunner(linkElements = elements), File(dir, "ck"), { HostCapture().writer }, bind = InetAddress.getLoopbackAddress())
            try {
                assertEquals(limit, rt.linkMaxFrame)
                assertEquals(16 * elements + (1L shl 20) + (64L shl 10), limit, "zl_mobile.links.link_frame_limit's formula")
                // the downstream end of the stage's outbound link
                val down = Conn(downServer.accept())
                deviceHandshake(down.r, down.w, DeviceAuth(downToken, "down"), Messages.hello("down", "test", 0, listOf("link")))
                down.r.maxFrame = Frames.DEFAULT_MAX_FRAME
                down.w.write(Message(MsgType.REPLAY_REQUEST, linkedMapOf("from_micro_batch" to 0L, "to_micro_batch" to LinkRules.NO_END)))
                down.w.write(Messages.credit(1))
                // the upstream end of its inbound link
                val up = upstream(rt, upToken)
                assertEquals(2L, up.r.read().long("credits"))

                // a legitimate hidden state (200 kB of h) goes through the stage and out downstream
                up.w.write(Messages.hiddenState(0, 0, Tensor.ofFloats(FloatArray(50_000) { it.toFloat() }, 1, 50_000)))
                val out = down.r.read()
                assertEquals(MsgType.HIDDEN_STATE, out.type, out.toString())
                assertEquals(0L, out.long("micro_batch"))
                assertEquals(50_000, out.tensor("h").toFloatArray().size)

                // inbound: a header declaring one byte more than the limit is OVERSIZED at once
                up.raw.write(header(limit - 20 + 1)); up.raw.flush()
                val e = up.refusal()
                assertEquals("OVERSIZED", e.string("code"), e.toString())
                assertTrue(e.string("message").contains("exceeds the ${"%.1f".format(limit / 1048576.0)} MiB limit"), e.string("message"))
                up.close()

                // exactly the limit is allowed: the link waits for the body (TRUNCATED when it never comes)
                upstream(rt, upToken).use { up2 ->
                    up2.raw.write(header(limit - 20)); up2.raw.write(ByteArray(1000)); up2.raw.flush()
                    up2.s.shutdownOutput()
                    val t = up2.refusal()
                    assertEquals("TRUNCATED", t.string("code"), t.toString())
                }

                // outbound: the downstream declaring more than the limit gets OVERSIZED, the link is dropped
                down.use {
                    down.raw.write(header(limit - 20 + 1)); down.raw.flush()
                    val o = down.refusal()
                    assertEquals("OVERSIZED", o.string("code"), o.toString())
                }
            } finally {
                rt.stop()
            }
        }
    }
}
