package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.device.AffineChunkRunner
import org.zerolock.core.device.DeviceInfo
import org.zerolock.core.device.DeviceServer
import org.zerolock.core.device.RunnerFactory
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.Tensor
import org.zerolock.core.protocol.hostHandshake
import java.io.IOException
import java.net.InetAddress
import java.net.Socket
import java.net.SocketTimeoutException
import java.nio.file.Files

/**
 * tests/vectors/session_rules/host_sends.json, which zl-phone passes too
 * (tests/test_session_rules_vectors.py): what a device does with a message a host must not send
 * after the handshake (PROTOCOL.md 5.1: an ERROR about one request carries its request_id and the
 * session goes on; one without is about the session, and its sender closes).
 */
class SessionRulesVectorsTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/session_rules/host_sends.json").readText()).asObject()

    @Suppress("UNCHECKED_CAST")
    private fun message(c: Map<String, Any?>): Message {
        val tensors = LinkedHashMap<String, Tensor>()
        for ((name, t) in (c["tensors"] as Map<String, Any?>?) ?: emptyMap()) {
            val o = t.asObject()
            val dtype = DType.fromName(o.str("dtype")) ?: error("unknown dtype in $o")
            val shape = (o["shape"] as List<Number>).map { it.toLong() }.toLongArray()
            tensors[name] = Tensor(dtype, shape, ByteArray((shape.fold(1L) { a, b -> a * b } * dtype.itemSize).toInt()))
        }
        return Message(MsgType.valueOf(c.str("type")), LinkedHashMap(c["meta"].asObject()), tensors)
    }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `host messages out of place`(): List<DynamicTest> {
        val token = Handshake.newToken()
        val dir = Files.createTempDirectory("session-rules").toFile()
        return (v["cases"] as List<Any?>).map { cs ->
            val c = cs.asObject()
            DynamicTest.dynamicTest(c.str("description")) {
                DeviceServer(DeviceInfo("rules", "test", 1L shl 30), token, java.io.File(dir, "files"), java.io.File(dir, "ck"),
                    RunnerFactory { _, _ -> AffineChunkRunner() }).use { srv ->
                    val port = srv.start(0, InetAddress.getLoopbackAddress())
                    Socket(InetAddress.getLoopbackAddress(), port).use { s ->
                        s.soTimeout = 10_000
                        val r = FrameReader(s.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
                        val w = FrameWriter(s.getOutputStream().buffered())
                        hostHandshake(r, w, token, "rules"); r.maxFrame = Frames.DEFAULT_MAX_FRAME
                        w.write(message(c))
                        val want = c["reply"]?.asObject()
                        if (want != null) {
                            val got = r.read()
                            assertEquals(want.str("type"), got.type.name, got.toString())
                            assertEquals(want.str("code"), got.string("code"), got.toString())
                            assertEquals((want["request_id"] as Number?)?.toLong(), got.meta["request_id"], got.toString())
                            assertTrue(got.string("message").all { it.code in 0x20..0x7e }, got.toString())
                        }
                        if (c["closes"] == true) {
                            val after = try { r.read() } catch (_: IOException) { null }
                            assertNull(after, "the device sent $after where it should have closed the session")
                        } else {
                            w.write(Messages.heartbeat(5)) // still served, and nothing else was sent before
                            val hb = r.read()
                            assertEquals(MsgType.HEARTBEAT, hb.type, hb.toString()); assertEquals(5L, hb.long("seq"))
                            s.soTimeout = 200
                            assertThrows<SocketTimeoutException> { r.read() }
                        }
                    }
                }
            }
        }
    }
}
