package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNotEquals
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Seal
import org.zerolock.core.protocol.Sealing

/** tests/vectors/sealing/vectors.json (tests/test_sealing.py runs it too): PROTOCOL.md 6.1. */
class SealingVectorsTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/sealing/vectors.json").readText()).asObject()
    private fun hex(k: String): ByteArray = Handshake.unhex(v[k] as String)
    private fun key(direction: Any?): ByteArray = if (direction == "h2d") hex("key_h2d") else hex("key_d2h")

    @Test
    fun `keys from the token, the nonces and the X25519 shares`() {
        val hp = Sealing.privateFromRaw(hex("host_private"))
        val dp = Sealing.privateFromRaw(hex("device_private"))
        val dh = Sealing.sharedSecret(hp, hex("device_share"))
        assertArrayEquals(hex("dh"), dh)
        assertArrayEquals(dh, Sealing.sharedSecret(dp, hex("host_share")))
        val (h2d, d2h) = Sealing.deriveKeys(hex("token"), hex("host_nonce"), hex("device_nonce"), dh, hex("host_share"), hex("device_share"))
        assertArrayEquals(hex("key_h2d"), h2d)
        assertArrayEquals(hex("key_d2h"), d2h)
        assertNotEquals(Handshake.hex(h2d), Handshake.hex(d2h))
        assertArrayEquals(hex("nonce_of_counter_7"), Sealing.nonce(7))
        // a fresh share's raw public key is what the JDK's key agreement pairs with
        val a = Sealing.newShare(); val b = Sealing.newShare()
        assertArrayEquals(Sealing.sharedSecret(a.private, b.public), Sealing.sharedSecret(b.private, a.public))
    }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `sealed frames open to their plain vectors and seal to the same bytes`(): List<DynamicTest> =
        (v["frames"] as List<Map<String, Any?>>).map { f ->
            DynamicTest.dynamicTest(f["name"] as String) {
                val counter = (f["counter"] as Number).toLong()
                val sealed = Handshake.unhex(f["sealed_hex"] as String)
                val plain = TestSupport.file("tests/vectors/${f["plain_vector"]}.bin").readBytes()
                val want = Frames.decodeOne(plain, Frames.DEFAULT_MAX_FRAME)
                val r = FrameReader(sealed.inputStream(), Frames.DEFAULT_MAX_FRAME)
                r.seal = Seal(ByteArray(32), key(f["direction"]), received = counter)
                val got = r.read()
                assertEquals(want.type, got.type)
                assertEquals(want.meta, got.meta)
                assertEquals(want.tensors.keys, got.tensors.keys)
                for ((k, t) in want.tensors) assertArrayEquals(t.data, got.tensors.getValue(k).data)
                // sealing is deterministic given key, counter, header and body: Kotlin's bytes equal Python's
                val body = plain.copyOfRange(16, plain.size - 4)
                val header = sealed.copyOfRange(0, 16)
                val s = Seal(key(f["direction"]), ByteArray(32), sent = counter).seal(header, body)
                assertArrayEquals(sealed.copyOfRange(16, sealed.size - 4), s)
            }
        }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `tampered frames fail with their error`(): List<DynamicTest> =
        (v["tampered"] as List<Map<String, Any?>>).map { c ->
            DynamicTest.dynamicTest(c["name"] as String) {
                val r = FrameReader(Handshake.unhex(c["sealed_hex"] as String).inputStream(), Frames.DEFAULT_MAX_FRAME)
                r.seal = Seal(ByteArray(32), key(c["direction"]), received = (c["counter"] as Number).toLong())
                val e = assertThrows<ProtocolException> { r.read() }
                assertEquals(c["error"], e.code.name, "${c["why"]}: got ${e.message}")
            }
        }
}
