package org.zerolock.app

import android.app.ActivityManager
import android.content.Context
import android.content.Intent
import android.content.IntentFilter
import android.os.BatteryManager
import android.os.Debug
import android.os.PowerManager
import org.zerolock.core.device.StatsProvider

/** PSS of this process, battery temperature and thermal status: the numbers the host reports. */
class DeviceStats(private val context: Context) : StatsProvider {
    /** Proportional set size of this process in bytes (Debug.MemoryInfo reports KiB). */
    fun pssBytes(): Long {
        val mi = Debug.MemoryInfo()
        Debug.getMemoryInfo(mi)
        return mi.totalPss.toLong() * 1024L
    }

    /** Battery temperature in °C from the sticky ACTION_BATTERY_CHANGED broadcast, or null. */
    fun batteryTempC(): Double? {
        val intent: Intent = context.registerReceiver(null, IntentFilter(Intent.ACTION_BATTERY_CHANGED)) ?: return null
        val tenths = intent.getIntExtra(BatteryManager.EXTRA_TEMPERATURE, Int.MIN_VALUE)
        return if (tenths == Int.MIN_VALUE) null else tenths / 10.0
    }

    /** PowerManager.THERMAL_STATUS_* (0 = none ... 6 = shutdown). */
    fun thermalStatus(): Int = (context.getSystemService(Context.POWER_SERVICE) as PowerManager).currentThermalStatus

    /** Total RAM of the phone in bytes (advertised as `mem`). */
    fun totalMemBytes(): Long {
        val mi = ActivityManager.MemoryInfo()
        (context.getSystemService(Context.ACTIVITY_SERVICE) as ActivityManager).getMemoryInfo(mi)
        return mi.totalMem
    }

    /** What this app can take before Android's low-memory killer would end it (HELLO `memory_budget_bytes`):
     *  the memory available now less the threshold at which the system starts killing, plus what this process
     *  already holds. ExecuTorch allocates natively, so the Java heap's memory class does not bound it. */
    fun memoryBudgetBytes(): Long {
        val mi = ActivityManager.MemoryInfo()
        (context.getSystemService(Context.ACTIVITY_SERVICE) as ActivityManager).getMemoryInfo(mi)
        return maxOf(0L, mi.availMem - mi.threshold) + pssBytes()
    }

    override fun sample(): Pair<Long, Double?> = Pair(pssBytes(), batteryTempC())
}
