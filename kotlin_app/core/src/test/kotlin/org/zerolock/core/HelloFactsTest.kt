package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.zerolock.core.device.DeviceInfo
import org.zerolock.core.device.HelloFacts
import org.zerolock.core.device.MemoryLimit
import java.io.File
import java.nio.file.Files

/** HELLO's cores, cpu_share and memory_budget_bytes, with zl_mobile/device.py's names, types and absences. */
class HelloFactsTest {
    @Test
    fun `cores count the affinity list as sched_getaffinity does`() {
        assertEquals(7, HelloFacts.cpuListCount("0-3,8,10-11"))
        assertEquals(1, HelloFacts.cpuListCount("5\n"))
        val status = File(Files.createTempDirectory("hello").toFile(), "status")
        status.writeText("Name:\tjava\nCpus_allowed:\tff\nCpus_allowed_list:\t0-1,4\n")
        assertEquals(3, HelloFacts.cores(status))
        status.delete()
        assertEquals(Runtime.getRuntime().availableProcessors(), HelloFacts.cores(status)) // no /proc: the JVM's count
        assertTrue(HelloFacts.cores() >= 1)
    }

    @Test
    fun `HELLO carries the budget, the share only when given, and the budget read afresh`() {
        var reads = 0
        val info = DeviceInfo("p", "kotlin/test", 1L shl 30, extra = HelloFacts.fixed(2, 0.45),
            live = { reads++; HelloFacts.live(MemoryLimit(600L shl 20)) })
        val meta = info.hello().meta
        assertEquals(2L, meta["cores"])
        assertEquals(0.45, meta["cpu_share"])
        assertEquals(600L shl 20, meta["memory_budget_bytes"])
        info.hello()
        assertEquals(2, reads)
        val plain = DeviceInfo("q", "kotlin/test", 1L shl 30, extra = HelloFacts.fixed(4, null), live = { HelloFacts.live(null) }).hello().meta
        assertFalse("cpu_share" in plain)
        assertEquals(MemoryLimit.availableBytes() != null, "memory_budget_bytes" in plain) // MemAvailable, as zl_mobile
    }

    /** HELLO memory_bytes is the device's RAM (issue 51: DeviceMain sent the JVM's -Xmx, below its own budget). */
    @Test
    fun `memory_bytes is the device's total RAM, not the JVM heap`() {
        val meminfo = File(Files.createTempDirectory("hello").toFile(), "meminfo")
        meminfo.writeText("MemTotal:       16303448 kB\nMemFree:         1000000 kB\nMemAvailable:    9000000 kB\n")
        assertEquals(16303448L * 1024, HelloFacts.totalMemoryBytes(meminfo))
        meminfo.delete()
        assertEquals(0L, HelloFacts.totalMemoryBytes(meminfo), "unreadable: 0, as zl_mobile")
        val total = HelloFacts.totalMemoryBytes()
        if (File("/proc/meminfo").canRead()) {
            assertTrue(total > Runtime.getRuntime().maxMemory(), "$total is not more than the heap limit")
            assertTrue(total >= (MemoryLimit.availableBytes() ?: 0L), "the total is at least what is available")
        }
    }
}
