package org.zerolock.core

import java.io.File

object TestSupport {
    /** Repository root: -Dzerolock.repoRoot (set by run_tests.sh), else found from the cwd. */
    val repoRoot: File by lazy {
        System.getProperty("zerolock.repoRoot")?.let { return@lazy File(it) }
        var d: File? = File("").absoluteFile
        while (d != null) {
            if (File(d, "kotlin_app/run_tests.sh").exists()) return@lazy d
            d = d.parentFile
        }
        error("cannot find the repository root: pass -Dzerolock.repoRoot=/path/to/repo")
    }

    fun file(rel: String): File = File(repoRoot, rel)

    @Suppress("UNCHECKED_CAST")
    fun floats(v: Any?): FloatArray = (v as List<Number>).map { it.toFloat() }.toFloatArray()

    fun relClose(a: Float, b: Float, rel: Double): Boolean {
        if (a == b) return true
        val scale = maxOf(Math.abs(a.toDouble()), Math.abs(b.toDouble()))
        return Math.abs(a.toDouble() - b.toDouble()) <= rel * scale
    }
}

/**
 * Kotlin-friendly assertThrows. (Debian's junit5 jars do not ship JUnit's Kotlin extensions, so
 * the tests define their own.)
 */
inline fun <reified T : Throwable> assertThrows(block: () -> Unit): T {
    try {
        block()
    } catch (e: Throwable) {
        if (e is T) return e
        throw AssertionError("expected ${T::class.java.name}, got ${e::class.java.name}: ${e.message}", e)
    }
    throw AssertionError("expected ${T::class.java.name}, nothing was thrown")
}
