package org.zerolock.core.device

import java.io.File
import java.io.IOException

/**
 * HELLO's optional budget fields, as zl_mobile/device.py sends them (PROTOCOL.md 3, HELLO): `cores`
 * (uint), `cpu_share` (number, only when the process is held to a share) and `memory_budget_bytes`
 * (uint: the --mem-limit, else MemAvailable read afresh for each HELLO; left out where unknown).
 */
object HelloFacts {
    /** The static fields: `cores` and, when given, `cpu_share`. */
    fun fixed(cores: Int, cpuShare: Double?): Map<String, Any?> =
        LinkedHashMap<String, Any?>().apply {
            put("cores", cores.toLong())
            if (cpuShare != null) put("cpu_share", cpuShare)
        }

    /** `memory_budget_bytes` now (zl_mobile: `if (b := budget_bytes(limit))`, so a 0 or unknown budget is left out). */
    fun live(limit: MemoryLimit?): Map<String, Any?> =
        MemoryLimit.budgetBytes(limit)?.takeIf { it > 0 }?.let { mapOf("memory_budget_bytes" to it) } ?: emptyMap()

    /**
     * HELLO `memory_bytes`: the device's total RAM (MemTotal of /proc/meminfo, Linux and Android), as
     * zl_mobile's total_memory_bytes; 0 where it cannot be read. Never the JVM's heap limit (-Xmx):
     * the planner compares it with `memory_budget_bytes`, which counts native memory too.
     */
    fun totalMemoryBytes(meminfo: File = File("/proc/meminfo")): Long = try {
        meminfo.readLines().firstOrNull { it.startsWith("MemTotal:") }
            ?.substringAfter(':')?.trim()?.split(Regex("\\s+"))?.firstOrNull()?.toLongOrNull()?.times(1024)
    } catch (_: IOException) {
        null
    } ?: 0L

    /**
     * The CPUs this process may run on, counted as Python's len(os.sched_getaffinity(0)): the
     * kernel's `Cpus_allowed_list` (taskset). Not Runtime.availableProcessors(): the JVM also
     * rounds a cgroup CPU quota into it, so a phone held to 0.5 of a core (zl_mobile.cpu_budget)
     * would say 1 where zl-phone says the machine's allowed cores. That only where /proc cannot be read.
     */
    fun cores(status: File = File("/proc/self/status")): Int = try {
        status.readLines().firstOrNull { it.startsWith("Cpus_allowed_list:") }
            ?.substringAfter(':')?.let { cpuListCount(it) }
    } catch (_: IOException) {
        null
    } catch (_: NumberFormatException) {
        null
    } ?: Runtime.getRuntime().availableProcessors()

    /** "0-3,8,10-11" -> 7 (the kernel's cpu list format). */
    fun cpuListCount(list: String): Int = list.trim().split(',').filter { it.isNotBlank() }.sumOf { part ->
        val ends = part.trim().split('-')
        if (ends.size == 1) 1 else ends[1].toInt() - ends[0].toInt() + 1
    }
}
