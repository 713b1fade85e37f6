package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.zerolock.core.device.MemoryLimit
import java.io.File
import java.nio.file.Files

/** DeviceMain --mem-limit: zl_mobile.memlimit's sizes, readings and budget (the watchdog itself: tests/test_kotlin_phone.py). */
class MemoryLimitTest {
    @Test
    fun `sizes parse as zl_mobile parse_size does`() {
        // expected values printed by zl_mobile.memlimit.parse_size
        val cases = mapOf("400M" to 419430400L, "1.5G" to 1610612736L, "800000k" to 819200000L, "600MiB" to 629145600L,
            "2gb" to 2147483648L, " 7 " to 7L, "0.5k" to 512L, ".5M" to 524288L, "1.1k" to 1126L, "123" to 123L)
        for ((text, bytes) in cases) assertEquals(bytes, MemoryLimit.parseSize(text), text)
        for (bad in listOf("12X", "", "M", "-1M", "1.5.G")) {
            val e = assertThrows<IllegalArgumentException> { MemoryLimit.parseSize(bad) }
            assertEquals("memory size '$bad' is not a number with an optional unit: give e.g. 600M or 1.5G", e.message)
        }
        for (zero in listOf("0", "0.0001")) {
            val e = assertThrows<IllegalArgumentException> { MemoryLimit.parseSize(zero) }
            assertEquals("memory size '$zero' must be more than 0 bytes", e.message)
        }
    }

    @Test
    fun `resident memory is VmRSS or the peak mark when higher, the budget the limit else MemAvailable`() {
        val dir = Files.createTempDirectory("memlimit").toFile()
        val status = File(dir, "status").apply { writeText("Name:\tjava\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n") }
        assertEquals(2048L * 1024, MemoryLimit.rssBytes(status))
        status.writeText("VmHWM:\t  100 kB\nVmRSS:\t  1024 kB\n")
        assertEquals(1024L * 1024, MemoryLimit.rssBytes(status))
        assertNull(MemoryLimit.rssBytes(File(dir, "missing")))
        // charged: PSS, plus the peak mark above the resident set now (a peak between two readings)
        File(dir, "smaps_rollup").writeText("00400000-7fff [rollup]\nRss:  3000 kB\nPss:   700 kB\n")
        status.writeText("VmHWM:\t  1500 kB\nVmRSS:\t  1024 kB\n")
        assertEquals((700L + 476) * 1024, MemoryLimit.chargedBytes(dir))
        status.writeText("VmHWM:\t  1024 kB\nVmRSS:\t  1024 kB\n")
        assertEquals(700L * 1024, MemoryLimit.chargedBytes(dir))
        File(dir, "smaps_rollup").delete()
        assertEquals(1024L * 1024, MemoryLimit.chargedBytes(dir)) // no PSS: the resident set
        assertNull(MemoryLimit.chargedBytes(File(dir, "missing")))
        val meminfo = File(dir, "meminfo").apply { writeText("MemTotal:  8000 kB\nMemFree:  10 kB\nMemAvailable:  5000 kB\n") }
        assertEquals(5000L * 1024, MemoryLimit.availableBytes(meminfo))
        assertEquals(600L shl 20, MemoryLimit.budgetBytes(MemoryLimit(600L shl 20)))
        // this process: a real reading, and the budget without a limit is what the kernel says is available
        assertTrue(MemoryLimit.rssBytes()!! > 1 shl 20)
        assertTrue(MemoryLimit.budgetBytes(null)!! > 0)
        assertEquals("kotlin-phone p: killed: memory (PSS) 30.5 MiB passed --mem-limit 20.0 MiB (as a phone's low-memory " +
            "killer would); give the stage fewer layers (zl-host plan) or the phone a larger limit",
            MemoryLimit.killedMessage("p", 32_000_000L, 20L shl 20))
        dir.deleteRecursively()
    }
}
