package org.zerolock.app

import android.os.Handler
import android.os.Looper
import org.zerolock.core.Telemetry

/** What the service publishes for the screen: state line, port, and telemetry history. */
object StatusBoard {
    data class Snapshot(val serving: Boolean, val port: Int, val status: String, val history: List<Telemetry>, val thermalStatus: Int)

    private val main = Handler(Looper.getMainLooper())
    private val listeners = mutableListOf<(Snapshot) -> Unit>()
    private var current = Snapshot(false, -1, "stopped", emptyList(), 0)
    private const val MAX_HISTORY = 2000

    @Synchronized fun snapshot(): Snapshot = current

    @Synchronized fun update(f: (Snapshot) -> Snapshot) {
        current = f(current)
        val s = current
        main.post { synchronized(this) { listeners.toList() }.forEach { it(s) } }
    }

    fun onTelemetry(t: Telemetry, thermal: Int) =
        update { it.copy(history = (it.history + t).takeLast(MAX_HISTORY), thermalStatus = thermal, status = "training") }

    @Synchronized fun listen(l: (Snapshot) -> Unit) { listeners += l; main.post { l(current) } }
    @Synchronized fun unlisten(l: (Snapshot) -> Unit) { listeners -= l }
}
