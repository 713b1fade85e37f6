package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test

/**
 * The line the Android app's NsdAdvertiser shows (and logs) when it refuses to advertise a name
 * (issue 31): [ZeroLockService.instanceNameRefusal], the rule of docs/PROTOCOL.md 10.2 that the
 * shared vectors (tests/vectors/mdns/mdns.json) fix for zl_mobile and the core alike.
 */
class DeviceNameTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/mdns/mdns.json").readText()).asObject()

    @Test
    fun `every name the vectors refuse gets one line naming the name and the problem, the others none`() {
        @Suppress("UNCHECKED_CAST")
        for (c in v["instance_names"] as List<Any?>) {
            val case = c.asObject()
            val name = case.str("label")
            val line = ZeroLockService.instanceNameRefusal(name)
            if (case["valid"] == true) { assertNull(line, name); continue }
            assertTrue(line != null && line.lines().size == 1, "$name: $line")
            assertTrue(line!!.startsWith("device name '") && line.endsWith(ZeroLockService.instanceNameProblem(name)!!), line)
        }
        assertEquals("device name 'new\\u000aline' contains the control character U+000A", ZeroLockService.instanceNameRefusal("new\nline"))
        assertEquals("device name '' is empty", ZeroLockService.instanceNameRefusal(""))
        val long = "a".repeat(64)
        assertEquals("device name '$long' is 64 bytes in UTF-8; an mDNS instance name is at most 63", ZeroLockService.instanceNameRefusal(long))
    }

    @Test
    fun `dots are one label on Android's NsdManager, so only zl-phone's python-zeroconf refuses edge dots`() {
        // NsdManager writes the service name as one label (labels[0]) whatever it holds; PROTOCOL.md
        // 10.2 allows these, and the advertiser registers them
        for (name in listOf("phone.", ".phone", "a..b", "...", ".", "x._sub", "Dr. Who's phone")) {
            assertNull(ZeroLockService.instanceNameRefusal(name), name)
        }
    }
}
