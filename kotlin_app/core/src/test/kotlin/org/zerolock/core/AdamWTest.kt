package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory

class AdamWTest {
    private fun vectors(): Map<String, Any?> =
        Json.parse(TestSupport.file("kotlin_app/vectors/adamw.json").readText()).asObject()

    @TestFactory
    fun `matches torch optim AdamW`(): List<DynamicTest> {
        @Suppress("UNCHECKED_CAST")
        val cases = vectors()["cases"] as List<Map<String, Any?>>
        assertTrue(cases.size >= 4, "expected several cases")
        return cases.map { c ->
            DynamicTest.dynamicTest(c.str("name")) {
                val opt = AdamW(
                    lr = c.num("lr").toDouble(), beta1 = c.num("beta1").toDouble(), beta2 = c.num("beta2").toDouble(),
                    eps = c.num("eps").toDouble(), weightDecay = c.num("weight_decay").toDouble(),
                )
                val p = TestSupport.floats(c["init"])
                val st = AdamWState(p.size)
                @Suppress("UNCHECKED_CAST")
                val steps = c["steps"] as List<Map<String, Any?>>
                assertTrue(steps.size >= 3)
                var worst = 0.0
                for ((k, s) in steps.withIndex()) {
                    opt.step(p, TestSupport.floats(s["grad"]), st)
                    assertEquals(s.long("step"), st.step)
                    for ((label, mine, ref) in listOf(
                        Triple("param", p, TestSupport.floats(s["param"])),
                        Triple("exp_avg", st.expAvg, TestSupport.floats(s["exp_avg"])),
                        Triple("exp_avg_sq", st.expAvgSq, TestSupport.floats(s["exp_avg_sq"])),
                    )) {
                        for (i in mine.indices) {
                            val a = mine[i]; val b = ref[i]
                            if (a != b) worst = maxOf(worst, Math.abs(a - b) / maxOf(Math.abs(a), Math.abs(b)).toDouble())
                            assertTrue(TestSupport.relClose(a, b, 1e-6), "${c["name"]} step ${k + 1} $label[$i]: kotlin $a torch $b")
                        }
                    }
                }
                println("AdamW ${c["name"]}: ${steps.size} steps, worst relative difference $worst")
            }
        }
    }

    @Test
    fun `agrees with the textbook formula in double precision`() {
        val lr = 1e-2; val b1 = 0.9; val b2 = 0.99; val eps = 1e-8; val wd = 0.1
        val opt = AdamW(lr, b1, b2, eps, wd)
        val p = floatArrayOf(0.5f, -1.25f, 2f)
        val st = AdamWState(3)
        val pd = p.map { it.toDouble() }.toDoubleArray()
        val m = DoubleArray(3); val v = DoubleArray(3)
        val rnd = java.util.Random(7)
        for (t in 1..5) {
            val g = FloatArray(3) { rnd.nextGaussian().toFloat() }
            opt.step(p, g, st)
            for (i in 0 until 3) {
                pd[i] -= lr * wd * pd[i]
                m[i] = b1 * m[i] + (1 - b1) * g[i]
                v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
                val mhat = m[i] / (1 - Math.pow(b1, t.toDouble()))
                val vhat = v[i] / (1 - Math.pow(b2, t.toDouble()))
                pd[i] -= lr * mhat / (Math.sqrt(vhat) + eps)
            }
        }
        for (i in 0 until 3) assertEquals(pd[i], p[i].toDouble(), 1e-5)
    }

    @Test
    fun `rejects mismatched sizes and bad hyper-parameters`() {
        assertThrows<IllegalArgumentException> { AdamW().step(FloatArray(3), FloatArray(2), AdamWState(3)) }
        assertThrows<IllegalArgumentException> { AdamW(beta1 = 1.0) }
        assertThrows<IllegalArgumentException> { AdamW(lr = -1.0) }
    }
}
