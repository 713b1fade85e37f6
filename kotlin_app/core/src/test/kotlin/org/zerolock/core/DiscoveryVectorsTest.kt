package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertNotNull
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory

/** tests/vectors/mdns/mdns.json (docs/PROTOCOL.md section 10): the cases zl_mobile/mdns.py passes too. */
class DiscoveryVectorsTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/mdns/mdns.json").readText()).asObject()

    private fun hex(s: String): ByteArray = ByteArray(s.length / 2) { s.substring(2 * it, 2 * it + 2).toInt(16).toByte() }

    @Test
    fun `constants match the vectors`() {
        assertEquals(v.str("service_type"), ZeroLockService.TYPE_FQDN)
        assertEquals("${ZeroLockService.TYPE}.local.", ZeroLockService.TYPE_FQDN)
        assertEquals(v.long("proto"), ZeroLockService.PROTO.toLong())
        assertEquals(v.long("max_instance_bytes"), ZeroLockService.MAX_INSTANCE_BYTES.toLong())
    }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `TXT records`(): List<DynamicTest> = (v["txt"] as List<Any?>).map { c ->
        val case = c.asObject()
        DynamicTest.dynamicTest(case.str("name")) {
            // as NsdServiceInfo.getAttributes() hands them over: raw bytes, null for a key without '='
            val attrs = LinkedHashMap<String, ByteArray?>()
            for ((k, value) in case["txt"].asObject()) attrs[k] = (value as String?)?.toByteArray(Charsets.UTF_8)
            (case["txt_hex"] as Map<String, Any?>?)?.forEach { (k, h) -> attrs[k] = hex(h as String) }
            val got = ZeroLockTxt.check(attrs)
            val where = "${case.str("name")}: $got"
            assertEquals(case.str("status"), got.status, where)
            assertEquals((case["problems"] as List<String>).sorted(), got.problems.keys.sorted(), where)
            got.problems.values.forEach { assertTrue(it.isNotEmpty() && '\n' !in it, where) }
            (case["fields"] as Map<String, Any?>?)?.let { f ->
                val have = mapOf("name" to got.name, "proto" to got.proto?.toLong(), "runtime" to got.runtime,
                    "mem" to got.memBytes, "cpu_share" to got.cpuShare)
                for ((k, want) in f) {
                    val w = if (want is Number && k == "cpu_share") want.toDouble() else want
                    assertEquals(w, have[k], "$k: $where")
                }
            }
            // the text form (what ZeroLockTxt.fromAttributes reads) agrees when the bytes are UTF-8
            if (case["txt_hex"] == null) {
                val text = (case["txt"].asObject()).mapValues { it.value as String? }
                assertEquals(got, ZeroLockTxt.checkText(text), where)
                if (got.status == TxtCheck.OK) assertEquals(got.memBytes, ZeroLockTxt.fromAttributes(text).memBytes)
                else assertThrows<DnsSdTxt.TxtError> { ZeroLockTxt.fromAttributes(text) }
            }
        }
    }

    @TestFactory
    fun `instance names`(): List<DynamicTest> = (v["instance_names"] as List<*>).mapIndexed { i, c ->
        val case = c.asObject()
        DynamicTest.dynamicTest("$i ${case.str("label").take(20)}") {
            val label = case.str("label")
            val problem = ZeroLockService.instanceNameProblem(label)
            if (case["valid"] == true) {
                assertNull(problem, label)
                assertEquals(case.str("escaped"), ZeroLockService.escapeInstance(label))
            } else {
                assertNotNull(problem, label)
                assertFalse('\n' in problem!!)
            }
        }
    }

    @Test
    fun `a record off the wire - what the app advertises checks ok, bytes that are not UTF-8 are reported`() {
        val txt = ZeroLockTxt(name = "Dr. Who's phone", proto = 2, runtime = "executorch-1.5.1", memBytes = 8_000_000_000L,
            extra = mapOf("cpu_share" to "0.5"))
        val ok = ZeroLockTxt.checkRecord(txt.encode())
        assertEquals(TxtCheck(TxtCheck.OK, "Dr. Who's phone", 2, "executorch-1.5.1", 8_000_000_000L, 0.5), ok)
        val raw = DnsSdTxt.encode(linkedMapOf("proto" to "2", "runtime" to "r", "mem" to "1")) +
            byteArrayOf(6) + "name=".toByteArray() + byteArrayOf(0xff.toByte())
        val bad = ZeroLockTxt.checkRecord(raw)
        assertEquals(TxtCheck.INVALID, bad.status)
        assertEquals(mapOf("name" to "is not UTF-8"), bad.problems)
        val other = ZeroLockTxt.checkRecord(DnsSdTxt.encode(linkedMapOf("name" to "p", "proto" to "1", "mem" to "8GB")))
        assertEquals(TxtCheck.INCOMPATIBLE, other.status)
        assertEquals(setOf("proto"), other.problems.keys)
    }
}
