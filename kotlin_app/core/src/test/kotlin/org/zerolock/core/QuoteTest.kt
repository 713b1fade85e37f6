package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.protocol.Quote

/** tests/vectors/quoting.json: the one quoting rule for peer-supplied values, as zl_mobile's quote(). */
class QuoteTest {
    @Suppress("UNCHECKED_CAST")
    private val cases = Json.parse(TestSupport.file("tests/vectors/quoting.json").readText()) as List<Any?>

    @TestFactory
    fun `quoting vectors`(): List<DynamicTest> = cases.mapIndexed { i, c ->
        val o = c.asObject()
        DynamicTest.dynamicTest("case $i ${o.str("quoted").take(40)}") {
            assertEquals(o.str("quoted"), Quote.quote(o.str("value")))
        }
    }

    @Test
    fun `show gives numbers and objects as short one-line JSON`() {
        assertEquals("9223372036854775807", Quote.show(Long.MAX_VALUE))
        assertEquals("\"a\\nb\"", Quote.show("a\nb"))
        val long = Quote.show(List(100) { it.toLong() })
        assertTrue(long.endsWith("chars)") && long.length < 90, long)
    }
}
