package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Tensor
import java.io.File

/** Every vector in tests/vectors/ (read from the repository, never copied). */
class VectorsTest {
    private val dir: File = TestSupport.file("tests/vectors")

    private fun vectorFiles(): List<File> {
        assertTrue(dir.isDirectory, "no test vectors at $dir")
        return dir.listFiles { f -> f.name.endsWith(".bin") }!!.sortedBy { it.name }
    }

    @Test
    fun `the vector set is complete`() {
        val bins = vectorFiles()
        assertTrue(bins.size >= 50, "expected the full vector set, found ${bins.size}")
        for (b in bins) assertTrue(File(dir, b.name.removeSuffix(".bin") + ".json").exists(), "${b.name} lacks its .json")
    }

    @TestFactory
    fun `decode every vector`(): List<DynamicTest> = vectorFiles().map { bin ->
        val name = bin.name.removeSuffix(".bin")
        DynamicTest.dynamicTest(name) {
            val spec = Json.parse(File(dir, "$name.json").readText()).asObject()
            val bytes = bin.readBytes()
            val maxFrame = spec.long("max_frame")
            if (spec["valid"] == true) {
                val m = Frames.decodeOne(bytes, maxFrame)
                checkValid(name, spec, m)
                // re-encode in Kotlin; it must decode to the same message
                val again = Frames.decodeOne(Frames.encode(m), maxFrame)
                checkValid("$name (re-encoded)", spec, again)
                // and streams decode the same as buffers
                checkValid("$name (stream)", spec, FrameReader(bytes.inputStream(), maxFrame).read())
            } else {
                val e = assertThrows<ProtocolException> { Frames.decodeOne(bytes, maxFrame) }
                assertEquals(spec.str("error"), e.code.name, "$name: ${spec["description"]}: got ${e.message}")
            }
        }
    }

    private fun checkValid(name: String, spec: Map<String, Any?>, m: Message) {
        assertEquals(spec.str("type"), m.type.name, name)
        assertEquals(spec.long("type_code"), m.type.code.toLong(), name)
        assertEquals(spec["meta"], m.meta, "$name: metadata (compared as JSON values, ints vs floats)")
        val tensors = spec["tensors"].asObject()
        assertEquals(tensors.keys, m.tensors.keys, "$name: tensor names")
        for ((tn, tv) in tensors) {
            val t = tv.asObject()
            val mine = m.tensors[tn]!!
            assertEquals(t.str("dtype"), mine.dtype.wireName, "$name/$tn dtype")
            @Suppress("UNCHECKED_CAST")
            assertEquals((t["shape"] as List<Long>), mine.shape.toList(), "$name/$tn shape")
            assertEquals(t.long("crc32"), Frames.crc32(mine.data), "$name/$tn crc32")
            assertEquals(t.str("data_hex"), Handshake.hex(mine.data), "$name/$tn data")
            @Suppress("UNCHECKED_CAST")
            val values = t["values"] as List<Any?>
            when (mine.dtype) {
                DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16 -> {
                    val f = mine.toFloatArray()
                    assertEquals(values.size, f.size)
                    for (i in f.indices) {
                        val want = when (val v = values[i]) {
                            "NaN" -> Double.NaN; "Infinity" -> Double.POSITIVE_INFINITY; "-Infinity" -> Double.NEGATIVE_INFINITY
                            else -> (v as Number).toDouble()
                        }
                        assertEquals(want, f[i].toDouble(), "$name/$tn[$i]")
                    }
                }
                DType.BOOL -> assertEquals(values, mine.toBooleanArray().toList(), "$name/$tn")
                else -> assertEquals(values.map { (it as Number).toLong() }, mine.toLongArray().toList().let { l ->
                    if (mine.dtype == DType.UINT8) l else l
                }, "$name/$tn")
            }
        }
    }
}

class HandshakeTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/handshake.json").readText()).asObject()

    @Test
    fun `proofs match the handshake vector`() {
        val key = Handshake.parseToken(v.str("token"))
        val nh = Handshake.unhex(v.str("host_nonce"))
        val nd = Handshake.unhex(v.str("device_nonce"))
        assertEquals(v.str("host_input_hex"), Handshake.hex(Handshake.hostInput(nh, nd)))
        assertEquals(v.str("device_input_hex"), Handshake.hex(Handshake.deviceInput(nh, nd)))
        assertEquals(75, Handshake.hostInput(nh, nd).size)
        assertEquals(v.str("host_proof"), Handshake.hex(Handshake.hostProof(key, nh, nd)))
        assertEquals(v.str("device_proof"), Handshake.hex(Handshake.deviceProof(key, nh, nd)))
        assertEquals(v.str("host_proof_with_wrong_token"), Handshake.hex(Handshake.hostProof(Handshake.parseToken(v.str("wrong_token")), nh, nd)))
    }

    @Test
    fun `auth vectors carry the handshake values`() {
        val req = Frames.decodeOne(TestSupport.file("tests/vectors/auth_request.bin").readBytes())
        assertEquals(v.str("host_nonce"), req.string("host_nonce"))
        val resp = Frames.decodeOne(TestSupport.file("tests/vectors/auth_response.bin").readBytes())
        assertEquals(v.str("host_proof"), resp.string("host_proof"))
        val ok = Frames.decodeOne(TestSupport.file("tests/vectors/auth_ok.bin").readBytes())
        assertEquals(v.str("device_proof"), ok.string("device_proof"))
    }
}

class FrameCodecTest {
    @Test
    fun `crc32 is the IEEE one`() = assertEquals(0xCBF43926L, Frames.crc32("123456789".toByteArray()))

    @Test
    fun `round trip of a hidden state with all helper dtypes`() {
        val h = Tensor.ofFloats(FloatArray(2 * 3 * 4) { it * 0.5f - 3f }, 2, 3, 4)
        val m = Messages.hiddenState(7, 1, h, mapOf(
            "labels" to Tensor.ofLongs(longArrayOf(-100, 5, 6), 1, 3),
            "mask" to Tensor.ofBooleans(booleanArrayOf(false, true, true), 1, 3),
            "bf" to Tensor.ofBFloat16(floatArrayOf(1f, -2.5f)),
        ))
        val bytes = Frames.encode(m)
        // tensor data starts 8-aligned in the frame
        val back = Frames.decodeOne(bytes)
        assertEquals(7L, back.long("micro_batch"))
        assertArrayEquals(h.toFloatArray(), back.tensor("h").toFloatArray())
        assertArrayEquals(floatArrayOf(1f, -2.5f), back.tensor("bf").toFloatArray())
        assertEquals(listOf(-100L, 5L, 6L), back.tensor("labels").toLongArray().toList())
    }

    @Test
    fun `encoder refuses messages that break the schema`() {
        assertEquals(ErrorCode.MALFORMED, assertThrows<ProtocolException> { Frames.encode(Message(MsgType.CREDIT, mapOf("credits" to 0L))) }.code)
        assertEquals(3L, Frames.decodeOne(Frames.encode(Message(MsgType.HEARTBEAT, mapOf("seq" to 3)))).long("seq")) // Int widened to Long
        assertEquals(ErrorCode.MALFORMED, assertThrows<ProtocolException> { Frames.encode(Message(MsgType.HEARTBEAT, mapOf("seq" to -1))) }.code)
        assertThrows<IllegalArgumentException> { Frames.encode(Message(MsgType.TELEMETRY, mapOf("x" to Double.NaN))) }
    }

    @Test
    fun `stream reader - pre-auth limit, clean close, truncation`() {
        val big = Frames.encode(Message(MsgType.TELEMETRY, mapOf("pad" to "x".repeat(70_000))))
        assertEquals(ErrorCode.OVERSIZED, assertThrows<ProtocolException> { FrameReader(big.inputStream()).read() }.code)
        FrameReader(big.inputStream(), Frames.DEFAULT_MAX_FRAME).read()
        assertThrows<org.zerolock.core.protocol.ConnectionClosedException> { FrameReader(ByteArray(0).inputStream()).read() }
        val hb = Frames.encode(Messages.heartbeat(3))
        assertEquals(ErrorCode.TRUNCATED, assertThrows<ProtocolException> { FrameReader(hb.copyOf(hb.size - 1).inputStream()).read() }.code)
    }
}
