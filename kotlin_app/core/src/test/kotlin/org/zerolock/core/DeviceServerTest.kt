package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.AffineChunkRunner
import org.zerolock.core.device.DeviceInfo
import org.zerolock.core.device.DeviceServer
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

    private fun server(dir: File) = DeviceServer(
        DeviceInfo("jvm-test", "test", 1L shl 30), token, File(dir, "files"), File(dir, "ck"),
        RunnerFactory { _, _ -> AffineChunkRunner() }, echoHidden = true,
    )

    private class Conn(port: Int) : AutoCloseable {
        val s = Socket(InetAddress.getLoopbackAddress(), port).also { it.soTimeout = 10_000 }
        val r = FrameReader(s.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
        val w = FrameWriter(s.getOutputStream().buffered())
        override fun close() = s.close()
    }

    private fun assign(rid: Long, w: Int = 2) = Message(MsgType.STAGE_ASSIGN, linkedMapOf(
        "request_id" to rid, "stage" to 0, "num_stages" to 1, "upstream" to null, "downstream" to null,
        "program_sha256" to "0".repeat(64), "window_size" to w, "inflight_depth" to 2, "buffer_capacity" to 4,
        "config" to mapOf("lr" to 0.05)))

    @Test
    fun `session - handshake, assign, hidden states both ways, windows commit`(@TempDir dir: File) {
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
                c.w.write(assign(1))
                val ack = c.r.read()
                assertEquals(MsgType.ACK, ack.type, ack.toString()); assertTrue(ack.bool("ok"))
                val got = HashMap<MsgType, MutableList<Message>>()
                for (mb in 0L until 4L) {
                    c.w.write(Messages.hiddenState(mb, mb / 2, Tensor.ofFloats(FloatArray(6) { it + mb.toFloat() }, 1, 2, 3)))
                }
                var hidden = 0
                while (hidden < 4 || (got[MsgType.CHECKPOINT_COMMITTED]?.size ?: 0) < 2 || (got[MsgType.TELEMETRY]?.size ?: 0) < 4) {
                    val m = c.r.read()
                    got.getOrPut(m.type) { mutableListOf() }.add(m)
                    if (m.type == MsgType.HIDDEN_STATE) { hidden++; c.w.write(Messages.credit(1, m.long("micro_batch"))) }
                    assertTrue(m.type != MsgType.ERROR, m.toString())
                }
                val h0 = got[MsgType.HIDDEN_STATE]!!.first { it.long("micro_batch") == 0L }.tensor("h")
                assertEquals(listOf(1L, 2L, 3L), h0.shape.toList())
                assertEquals(0.5f, h0.toFloatArray()[0]) // a=0, b=0.5 before the first update
                assertEquals(4, got[MsgType.CREDIT]!!.size)
                val commits = got[MsgType.CHECKPOINT_COMMITTED]!!
                assertEquals(listOf(0L, 1L), commits.map { it.long("window") })
                val ck = File(dir, "ck").listFiles()!!.single { it.name.endsWith(".ckpt") }
                assertEquals(Handshake.hex(MessageDigest.getInstance("SHA-256").digest(ck.readBytes())), commits.last().string("sha256"))
                c.w.write(Message(MsgType.STATE_GET, linkedMapOf("request_id" to 9, "kind" to "lora")))
                var st: Message
                do { st = c.r.read() } while (st.type != MsgType.STATE_PUT)
                assertEquals(setOf("a", "b"), st.tensors.keys)
                assertTrue(st.tensor("b").toFloatArray()[0] < 0.5f, "training moved b towards the target")
                c.w.write(Message(MsgType.SHUTDOWN, mapOf("reason" to "done")))
            }
            // the slot is free again after the session ended
            Thread.sleep(200)
            Conn(port).use { c -> hostHandshake(c.r, c.w, token, "test-host") }
        }
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
}
