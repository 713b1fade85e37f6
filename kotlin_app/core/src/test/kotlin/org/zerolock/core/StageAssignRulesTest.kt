package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.device.StageAssignRules
import org.zerolock.core.device.StageAssignment
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException

/**
 * tests/vectors/stage_assign/stage_assign_rules.json: the cases zl_mobile/assign_rules.py passes too;
 * stage_assign_defaults.json: what a left-out key is read as, which zl_mobile's StageConfig takes too.
 */
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

    private val d = Json.parse(TestSupport.file("tests/vectors/stage_assign/stage_assign_defaults.json").readText()).asObject()

    /** The value [a] holds for a vector key ('config.x' is config's x), as the JSON reader gives it. */
    private fun read(a: StageAssignment, key: String): Any? = when (key) {
        "run_id" -> a.runId
        "downstream_token" -> a.downstreamToken
        "window_size" -> a.windowSize.toLong()
        "inflight_depth" -> a.inflightDepth.toLong()
        "replay_horizon" -> a.replayHorizon.toLong()
        "schedule" -> a.schedule
        "listen_port" -> a.listenPort.toLong()
        "config.lr" -> a.lr
        "config.weight_decay" -> a.weightDecay
        "config.alpha" -> a.alpha
        "config.total_micro_batches" -> a.totalMicroBatches
        "config.rollback_to_window" -> a.rollbackToWindow
        "config.inject_failure" -> a.injectFailure
        "config.busy_ms" -> a.busyMs
        "config.restart" -> a.restart
        "config.keep_checkpoints" -> a.keepCheckpoints
        else -> throw AssertionError("stage_assign_defaults.json pins $key, which StageAssignment does not read: add it")
    }

    @Test
    fun `a key left out takes the shared default`() {
        val minimal = deepCopy(d["minimal"]).asObject()
        StageAssignRules.validate(minimal) // the keys both devices require, and no more
        val a = StageAssignment(Message(MsgType.STAGE_ASSIGN, LinkedHashMap(minimal)))
        for ((key, want) in d["defaults"].asObject()) assertEquals(want, read(a, key), key)
        for ((key, own) in d["device_own"].asObject()) assertEquals(own.asObject()["kotlin"], read(a, key), key)
        a.check() // the defaults are an assignment this core runs
    }
}
