package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.device.AppFailure
import org.zerolock.core.device.FailureSpec
import org.zerolock.core.device.FaultInjector

/**
 * tests/vectors/stage_core/stage_core.json on the Kotlin core: what a TELEMETRY record sends
 * ([Telemetry.toMap]: unmade readings absent, non-finite ones named in `nonfinite`), the window
 * record's figures ([WindowTelemetry]), and how config.inject_failure entries are read and fire
 * ([FailureSpec], [FaultInjector]). The Python stage core runs the same file
 * (tests/test_stage_core_vectors.py), so a Kotlin phone and a Python one report and fail alike.
 */
class StageCoreVectorsTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/stage_core/stage_core.json").readText()).asObject()

    @Suppress("UNCHECKED_CAST")
    private fun cases(key: String): List<Map<String, Any?>> = (v[key] as List<Any?>).map { it.asObject() }

    /** The vectors' stand-ins for the numbers JSON cannot hold; numbers compared as doubles. */
    private fun num(x: Any?): Any? = when (x) {
        "NaN" -> Double.NaN
        "Infinity" -> Double.POSITIVE_INFINITY
        "-Infinity" -> Double.NEGATIVE_INFINITY
        is Number -> x.toDouble()
        is List<*> -> x.map(::num)
        is Map<*, *> -> x.entries.associate { (k, e) -> k to num(e) }
        else -> x
    }

    private fun dbl(x: Any?): Double? = num(x) as Double?

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `present`(): List<DynamicTest> = cases("present").map { c ->
        DynamicTest.dynamicTest(c.str("name")) {
            val record = (num(c["record"]) as Map<String, Any?>)
            assertEquals(num(c["sent"]), num(Telemetry.fromMap(record).toMap()))
        }
    }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `window records`(): List<DynamicTest> = cases("window_records").map { c ->
        DynamicTest.dynamicTest(c.str("name")) {
            val forwardOnly = c["forward_only"] as Boolean
            val zero = TelemetryCounters(0.0, 0.0, 0.0, 0, 0)
            val t = WindowTelemetry(c.long("stage").toInt(), c.str("schedule"), zero, forwardOnly = forwardOnly)
            val w = c.long("window")
            for (mb in (c["micro_batches"] as List<Any?>).map { it.asObject() }) {
                t.add(w, dbl(mb["phase1_s"])!!, dbl(mb["phase2_s"]) ?: 0.0, dbl(mb["loss"]), dbl(mb["task_loss"]), dbl(mb["consis_loss"]),
                    null, phase2 = !forwardOnly)
            }
            val sent = num(t.close(w, c.long("step"), 0.0, zero, 0, null, null)!!.toMap()) as Map<String, Any?>
            for ((k, want) in num(c["record"]) as Map<String, Any?>) {
                assertTrue(k in sent, "$k: $sent")
                assertEquals(want, sent[k], "$k: $sent")
            }
            for (k in c["absent"] as List<String>) assertTrue(k !in sent, "$k: $sent")
        }
    }

    @TestFactory
    fun `fault specs`(): List<DynamicTest> = cases("fault_specs").map { c ->
        DynamicTest.dynamicTest(c.str("name")) {
            val s = FailureSpec.of(c["spec"].asObject())
            val parsed = mapOf("window" to s.window, "point" to s.point, "mode" to s.mode, "detect" to s.detect, "seconds" to s.seconds)
            assertEquals(num(c["parsed"]), num(parsed))
        }
    }

    @TestFactory
    fun `fault firing`(): List<DynamicTest> = cases("fault_firing").map { c ->
        DynamicTest.dynamicTest(c.str("name")) {
            val dir = java.nio.file.Files.createTempDirectory("zl-faults").toFile()
            val logged = mutableListOf<String>()
            fun start() = FaultInjector(FailureSpec.listOf(c["specs"]), dir, c.str("run_id"), c.long("stage").toInt()) { logged += it }
            var faults = start()
            @Suppress("UNCHECKED_CAST")
            for ((i, st) in (c["steps"] as List<Any?>).withIndex()) {
                val step = st.asObject()
                val where = "${c.str("name")}, step $i $step"
                when {
                    step["restart"] == true -> faults = start()
                    "fail" in step -> {
                        logged.clear()
                        val fired = try { faults.maybeFail(step.str("fail"), step.long("window")); null } catch (e: AppFailure) { e.detect }
                        assertEquals(step["fires"] as String?, fired, where)
                        assertEquals((step["log"] as String?)?.let { listOf(it) } ?: emptyList<String>(), logged, where)
                    }
                    "slow" in step -> assertEquals(dbl(step["seconds"]), faults.slowSeconds(step.long("slow")), where)
                    "stall" in step -> assertEquals(dbl(step["seconds"]), faults.stallSeconds(step.long("stall")), where)
                    else -> error("unknown step in $where")
                }
            }
            dir.deleteRecursively()
        }
    }
}
