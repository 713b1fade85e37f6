package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.device.StageAssignRules
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.ProtocolException

/** tests/vectors/stage_assign/stage_assign_rules.json: the cases zl_mobile/assign_rules.py passes too. */
class StageAssignRulesTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/stage_assign/stage_assign_rules.json").readText()).asObject()

    @Suppress("UNCHECKED_CAST")
    private fun deepCopy(x: Any?): Any? = when (x) {
        is Map<*, *> -> LinkedHashMap<String, Any?>().also { m -> for ((k, e) in x) m[k as String] = deepCopy(e) }
        is List<*> -> x.map { deepCopy(it) }
        else -> x
    }

    @Suppress("UNCHECKED_CAST")
    private fun build(case: Map<String, Any?>): Map<String, Any?> {
        val meta = deepCopy(v["base"]) as LinkedHashMap<String, Any?>
        for ((key, value) in case["set"].asObject()) {
            val dot = key.indexOf('.')
            if (dot > 0) (meta.getOrPut(key.substring(0, dot)) { LinkedHashMap<String, Any?>() } as MutableMap<String, Any?>)[key.substring(dot + 1)] = value
            else meta[key] = value
        }
        for (key in case["drop"] as List<String>) meta.remove(key)
        return meta
    }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `stage assign rules`(): List<DynamicTest> = (v["cases"] as List<Any?>).map { c ->
        val case = c.asObject()
        DynamicTest.dynamicTest(case.str("description")) {
            val meta = build(case)
            val field = case["field"] as String?
            if (field == null) {
                StageAssignRules.validate(meta)
            } else {
                val e = assertThrows<ProtocolException> { StageAssignRules.validate(meta) }
                assertEquals(ErrorCode.REJECTED, e.code)
                assertTrue(e.detail.startsWith("STAGE_ASSIGN $field:"), e.detail)
                assertEquals(1L, e.requestId)
            }
        }
    }

    @Test
    fun `IPv6 literals are parsed without a resolver`() {
        for (ok in listOf("::1", "::", "fe80::1", "1:2:3:4:5:6:7:8", "::ffff:10.0.0.1", "2001:db8::")) assertTrue(StageAssignRules.isIpv6(ok), ok)
        for (bad in listOf("", "::zz", "1:2:3:4:5:6:7:8:9", "1::2::3", ":::", "12345::", "::1.2.3.256", "1:2:3:4:5:6:7")) assertFalse(StageAssignRules.isIpv6(bad), bad)
    }
}
