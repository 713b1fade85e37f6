package org.zerolock.core.device

import java.io.File
import java.io.IOException
import org.zerolock.core.ProcStats

/**
 * A phone's memory limit (DeviceMain --mem-limit), as zl_mobile/memlimit.py: Android kills an app
 * that takes too much, so a Kotlin phone with a limit ends itself the same way: a watchdog reads
 * its memory ([chargedBytes]: PSS, not RSS, which counts a weights file's page once per mapping)
 * every [periodMs] (or 20x what a reading cost) and, past the limit, prints one line saying why and halts with
 * [KILLED_EXIT_CODE] (no shutdown hook: a killed app runs none). The limit is also the budget HELLO
 * reports (`memory_budget_bytes`); without one the budget is MemAvailable, as in zl_mobile.
 */
class MemoryLimit(val limitBytes: Long, private val name: String = "phone", private val periodMs: Long = 50) {
    @Volatile var peak = 0L
        private set

    fun start(): MemoryLimit {
        Thread({ watch() }, "mem-limit").apply { isDaemon = true }.start()
        return this
    }

    private fun watch() {
        while (true) {
            val t0 = System.nanoTime()
            val used = chargedBytes() ?: return // no /proc (not Linux): nothing to watch, as a limit cannot be read
            peak = maxOf(peak, used)
            if (used > limitBytes) {
                System.err.println(killedMessage(name, used, limitBytes))
                System.err.flush()
                Runtime.getRuntime().halt(KILLED_EXIT_CODE)
            }
            // reading PSS walks the page tables (ms with a large weights file mapped): at most ~5% of a core
            Thread.sleep(maxOf(periodMs, 20 * (System.nanoTime() - t0) / 1_000_000))
        }
    }

    companion object {
        /** What a process killed by the kernel's (or a phone's low-memory) killer exits with: 128 + SIGKILL. */
        const val KILLED_EXIT_CODE = 137
        private val UNITS = mapOf("" to 1L, "k" to (1L shl 10), "m" to (1L shl 20), "g" to (1L shl 30))
        private val SIZE = Regex("""\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)(i?[bB])?\s*""")

        /** '600M', '1.5G', '800000k' or plain bytes -> bytes, as zl_mobile.memlimit.parse_size (same strings, same rounding). */
        fun parseSize(text: String): Long {
            val m = SIZE.matchEntire(text)
                ?: throw IllegalArgumentException("memory size '$text' is not a number with an optional unit: give e.g. 600M or 1.5G")
            val n = (m.groupValues[1].toDouble() * UNITS.getValue(m.groupValues[2].lowercase())).toLong()
            if (n <= 0) throw IllegalArgumentException("memory size '$text' must be more than 0 bytes")
            return n
        }

        /** zl-phone's line, word for word but for the program's name. */
        fun killedMessage(name: String, rss: Long, limit: Long): String =
            "kotlin-phone $name: killed: memory (PSS) ${mib(rss)} MiB passed --mem-limit ${mib(limit)} MiB " +
                "(as a phone's low-memory killer would); give the stage fewer layers (zl-host plan) or the phone a larger limit"

        private fun mib(bytes: Long) = String.format(java.util.Locale.ROOT, "%.1f", bytes / 1048576.0)

        /** The first `PREFIX value kB` line of a /proc file as bytes; null where missing or unreadable. */
        private fun kibLine(file: File, prefix: String): Long? = try {
            file.readLines().firstOrNull { it.startsWith(prefix) }
                ?.substring(prefix.length)?.trim()?.split(Regex("\\s+"))?.firstOrNull()?.toLongOrNull()?.times(1024)
        } catch (_: IOException) {
            null
        }

        /**
         * Resident memory now, or the kernel's peak mark (VmHWM) if higher, as zl_mobile's rss_bytes:
         * the mark also catches a peak inside a runtime call between two readings (the stage resets it
         * after each micro-batch, ProcStats.takePeakRssBytes). Null where /proc cannot be read.
         */
        fun rssBytes(status: File = File("/proc/self/status")): Long? {
            val rss = kibLine(status, "VmRSS:") ?: return null
            return maxOf(rss, kibLine(status, "VmHWM:") ?: 0L)
        }

        /**
         * What the limit charges, as zl_mobile.memlimit.charged_bytes: PSS now, plus what the peak
         * mark saw above the resident set now (a peak between two readings: the arenas' anonymous
         * memory, which PSS counts whole); [rssBytes] where PSS cannot be read, null without /proc.
         */
        fun chargedBytes(dir: File = File("/proc/self")): Long? {
            val status = File(dir, "status")
            val peakOrRss = rssBytes(status) ?: return null
            val pss = ProcStats(dir).pssBytes() ?: return peakOrRss
            val rssNow = kibLine(status, "VmRSS:") ?: return peakOrRss
            return pss + maxOf(0L, peakOrRss - rssNow)
        }

        /** MemAvailable from /proc/meminfo; null where unreadable (zl_mobile.memlimit.available_bytes). */
        fun availableBytes(meminfo: File = File("/proc/meminfo")): Long? = kibLine(meminfo, "MemAvailable:")

        /** What this device can give: its limit, else what is available (zl_mobile.memlimit.budget_bytes). */
        fun budgetBytes(limit: MemoryLimit?): Long? = limit?.limitBytes ?: availableBytes()
    }
}
