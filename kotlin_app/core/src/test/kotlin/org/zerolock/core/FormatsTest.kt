package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test

class JsonTest {
    @Test
    fun `parses and writes`() {
        val v = Json.parse("""{"a": [1, 2.5, -3e2, true, null, "x\"y\u00e9\n"], "b": {}, "c": NaN, "d": -Infinity}""").asObject()
        assertEquals(listOf(1L, 2.5, -300.0, true, null, "x\"yé\n"), v["a"])
        assertTrue((v["c"] as Double).isNaN())
        assertEquals(Double.NEGATIVE_INFINITY, v["d"])
        assertEquals(v["a"], Json.parse(Json.write(v)).asObject()["a"])
        assertThrows<Json.JsonError> { Json.parse("{\"a\":1,}") }
        assertThrows<Json.JsonError> { Json.parse("[1] x") }
    }

    /** One scanner, two modes: what the lenient reader takes, frame metadata (strict) refuses. */
    @Test
    fun `lenient and strict modes of the one scanner`() {
        val lenientOnly = mapOf(
            """{"a": NaN}""" to "NaN", """{"a": -Infinity}""" to "-Infinity",
            """{"a": 1, "a": 2}""" to "duplicate key", """{"a": 123456789012345678901234}""" to "int64 overflow",
            """{"a": 1e999}""" to "float overflow", """{"a": "\ud800"}""" to "lone surrogate",
            "{\"a\":" + "[".repeat(40) + "]".repeat(40) + "}" to "depth 41",
        )
        for ((text, why) in lenientOnly) {
            Json.parse(text) // accepted
            val e = assertThrows<org.zerolock.core.protocol.ProtocolException> {
                org.zerolock.core.protocol.MetaJson.parseObject(text.toByteArray())
            }
            assertEquals(org.zerolock.core.protocol.ErrorCode.MALFORMED, e.code, why)
        }
        val v = Json.parse("""{"a": 1, "a": 2, "big": 123456789012345678901234}""").asObject()
        assertEquals(2L, v["a"], "last value wins")
        assertEquals(1.2345678901234568e23, v["big"])
        for (bad in listOf("{\"a\": \"\\uZZZZ\"}", "[01]", "[1.]", "[-]", "{\"a\" 1}", "[\"\u0001\"]")) {
            assertThrows<Json.JsonError> { Json.parse(bad) }
            assertThrows<org.zerolock.core.protocol.ProtocolException> { org.zerolock.core.protocol.MetaJson.parseObject("{\"k\": $bad}".toByteArray()) }
        }
        assertThrows<Json.JsonError> { Json.parse("[".repeat(Json.MAX_DEPTH + 1) + "]".repeat(Json.MAX_DEPTH + 1)) }
        // the writers: insertion order + NaN (lenient), sorted keys and no NaN (strict)
        assertEquals("""{"b":1,"a":NaN}""", Json.write(linkedMapOf("b" to 1, "a" to Double.NaN)))
        assertEquals("""{"a":"\u0001","b":1}""", String(org.zerolock.core.protocol.MetaJson.encode(linkedMapOf("b" to 1L, "a" to "\u0001"))))
        assertThrows<IllegalArgumentException> { org.zerolock.core.protocol.MetaJson.encode(mapOf("a" to Double.NaN)) }
    }
}

class TelemetryTest {
    @Test
    fun `round trip with an unknown temperature and unknown keys`() {
        val text = """{"stage": 1, "window": 4, "step": 5, "loss": 1.5, "task_loss": 2.25, "consis_loss": 0.125, "pss_bytes": 734003200,
            "temperature_c": null, "active_s": 12.5, "wait_s": 3.0, "thermal": "light"}"""
        val t = Telemetry.fromJson(text)
        assertEquals(1, t.stage); assertEquals(734003200L, t.pssBytes); assertNull(t.tempC)
        assertEquals(2.25, t.taskLoss); assertEquals(1.5, t.loss); assertEquals("light", t.extra["thermal"])
        assertEquals(t, Telemetry.fromJson(t.toJson()))
        assertTrue("temperature_c" !in t.toMap(), "an unknown temperature is omitted on the wire")
        val hot = Telemetry.fromJson(text.replace("null", "36.5"))
        assertEquals(36.5, hot.tempC)
        assertEquals(36.5, hot.toMap()["temperature_c"])
        // it is a valid TELEMETRY message, and survives the frame codec
        val back = org.zerolock.core.protocol.Frames.decodeOne(org.zerolock.core.protocol.Frames.encode(hot.toMessage()))
        assertEquals(hot, Telemetry.fromMessage(back))
    }

    @Test
    fun `parses the protocol's telemetry test vector`() {
        val v = Json.parse(TestSupport.file("tests/vectors/telemetry.json").readText()).asObject()
        val m = org.zerolock.core.protocol.Frames.decodeOne(TestSupport.file("tests/vectors/telemetry.bin").readBytes())
        val t = Telemetry.fromMessage(m)
        val meta = v["meta"].asObject()
        assertEquals(meta.long("stage").toInt(), t.stage)
        assertEquals(meta["temperature_c"], t.tempC)
        assertEquals(meta["pss_bytes"], t.pssBytes)
        for ((k, x) in meta) if (k !in Telemetry.KEYS) assertEquals(x, t.extra[k], "extra key $k kept")
    }

    @Test
    fun `kind is always written, absent means micro_batch, and the window keys round-trip`() {
        val base = """{"stage": 0, "window": 3, "step": 3, "pss_bytes": 10, "active_s": 1.5, "wait_s": 0.5"""
        val old = Telemetry.fromJson("$base}")
        assertEquals(Telemetry.MICRO_BATCH, old.kind); assertEquals(false, old.isWindow)
        assertEquals("micro_batch", old.toMap()["kind"], "kind is sent on every record")
        val w = Telemetry.fromJson("""$base, "kind": "window", "micro_batches": 4, "loss": 2.5, "phase1_s": 0.25, "phase2_s": 0.75,
            "step_s": 0.125, "seconds": 3.5, "bytes_in": 4096, "bytes_out": 2048, "rss_peak_bytes": 123456789, "schedule": "zerolock"}""")
        assertTrue(w.isWindow); assertEquals(4L, w.microBatches); assertEquals(0.25, w.phase1S); assertEquals(0.75, w.phase2S)
        assertEquals(0.125, w.stepS); assertEquals(3.5, w.seconds); assertEquals(4096L, w.bytesIn); assertEquals(2048L, w.bytesOut)
        assertEquals(123456789L, w.rssPeakBytes); assertEquals(mapOf("schedule" to "zerolock"), w.extra)
        assertEquals(w, Telemetry.fromMessage(org.zerolock.core.protocol.Frames.decodeOne(org.zerolock.core.protocol.Frames.encode(w.toMessage()))))
        assertEquals("window", w.toMap()["kind"])
        for (k in listOf("micro_batches", "phase1_s", "phase2_s", "step_s", "seconds", "bytes_in", "bytes_out", "rss_peak_bytes")) {
            assertTrue(k !in old.toMap(), "$k left out when not known")
        }
        assertThrows<Json.JsonError> { Telemetry.fromJson("$base, \"kind\": 1}") }
        assertThrows<Json.JsonError> { Telemetry.fromJson("$base, \"rss_peak_bytes\": -1}") }
    }

    @Test
    fun `rejects missing and mistyped fields`() {
        assertThrows<Json.JsonError> { Telemetry.fromJson("""{"stage": 0}""") }
        assertThrows<Json.JsonError> {
            Telemetry.fromJson("""{"stage": "0", "window": 0, "step": 0, "pss_bytes": 1, "active_s": 0, "wait_s": 0}""")
        }
        assertThrows<Json.JsonError> {
            Telemetry.fromJson("""{"stage": 0, "window": 0, "step": 0, "pss_bytes": -1, "active_s": 0, "wait_s": 0}""")
        }
    }
}

class TxtRecordTest {
    @Test
    fun `encodes DNS-SD key=value strings and decodes them back`() {
        val txt = ZeroLockTxt(name = "Pixel 8", proto = 2, runtime = "executorch-1.5.1", memBytes = 8_000_000_000L)
        val bytes = txt.encode()
        val expected = listOf("name=Pixel 8", "proto=2", "runtime=executorch-1.5.1", "mem=8000000000")
            .flatMap { listOf(it.length.toByte()) + it.toByteArray().toList() }.toByteArray()
        assertArrayEquals(expected, bytes)
        assertEquals(txt, ZeroLockTxt.decode(bytes))
    }

    @Test
    fun `DNS-SD rules - case-insensitive keys, first wins, boolean attributes, empty record`() {
        val raw = DnsSdTxt.encode(linkedMapOf("Name" to "a", "name" to "b", "flag" to null, "empty" to ""))
        val m = DnsSdTxt.decode(raw)
        assertEquals("a", m["name"]); assertTrue(m.containsKey("flag")); assertNull(m["flag"]); assertEquals("", m["empty"])
        assertArrayEquals(byteArrayOf(0), DnsSdTxt.encode(emptyMap()))
        assertTrue(DnsSdTxt.decode(byteArrayOf(0)).isEmpty())
        assertThrows<DnsSdTxt.TxtError> { DnsSdTxt.decode(byteArrayOf(5, 'a'.code.toByte())) }
        assertThrows<DnsSdTxt.TxtError> { DnsSdTxt.encode(mapOf("k" to "x".repeat(300))) }
        assertThrows<DnsSdTxt.TxtError> { ZeroLockTxt.fromAttributes(mapOf("name" to "x", "proto" to "1", "runtime" to "r")) }
        assertThrows<DnsSdTxt.TxtError> { ZeroLockTxt.fromAttributes(mapOf("name" to "x", "proto" to "one", "runtime" to "r", "mem" to "1")) }
    }
}
