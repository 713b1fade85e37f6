package org.zerolock.app

import android.Manifest
import android.app.Activity
import android.content.Context
import android.graphics.Canvas
import android.graphics.Color
import android.graphics.Paint
import android.graphics.Typeface
import android.os.Bundle
import android.view.View
import android.widget.Button
import android.widget.LinearLayout
import android.widget.ScrollView
import android.widget.TextView
import org.zerolock.core.Telemetry
import java.util.Locale

/**
 * Pairing token, stage / window / step, loss over time, PSS, temperature, active / wait time.
 * Built in code (no layouts): the screen is a status board for the service.
 */
class MainActivity : Activity() {
    private lateinit var tokenView: TextView
    private lateinit var statusView: TextView
    private lateinit var statsView: TextView
    private lateinit var chart: LossChart
    private lateinit var toggle: Button
    private lateinit var store: CheckpointStore
    private val listener: (StatusBoard.Snapshot) -> Unit = { render(it) }

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        store = CheckpointStore(this)
        if (checkSelfPermission(Manifest.permission.POST_NOTIFICATIONS) != android.content.pm.PackageManager.PERMISSION_GRANTED) {
            requestPermissions(arrayOf(Manifest.permission.POST_NOTIFICATIONS), 1)
        }
        val pad = (16 * resources.displayMetrics.density).toInt()
        val col = LinearLayout(this).apply { orientation = LinearLayout.VERTICAL; setPadding(pad, pad, pad, pad) }
        fun label(text: String) = TextView(this).apply { this.text = text; textSize = 13f; setTextColor(Color.GRAY) }
        tokenView = TextView(this).apply { typeface = Typeface.MONOSPACE; textSize = 16f; setTextIsSelectable(true) }
        statusView = TextView(this).apply { textSize = 16f }
        statsView = TextView(this).apply { typeface = Typeface.MONOSPACE; textSize = 14f }
        chart = LossChart(this)
        toggle = Button(this).apply { setOnClickListener { onToggle() } }
        val newToken = Button(this).apply {
            text = getString(R.string.new_token)
            setOnClickListener { store.newToken(); showToken(); if (StatusBoard.snapshot().serving) { TrainingService.stop(this@MainActivity); TrainingService.start(this@MainActivity) } }
        }
        col.addView(label("Pairing token (give it to zl-host)"))
        col.addView(tokenView)
        col.addView(newToken)
        col.addView(label("Status"))
        col.addView(statusView)
        col.addView(toggle)
        col.addView(label("Loss over time (task = blue, local total = black)"))
        col.addView(chart, LinearLayout.LayoutParams(LinearLayout.LayoutParams.MATCH_PARENT, (220 * resources.displayMetrics.density).toInt()))
        col.addView(statsView)
        setContentView(ScrollView(this).apply { addView(col) })
        showToken()
    }

    private fun showToken() {
        // grouped in blocks of 8 for reading aloud / typing; zl-host accepts it with or without spaces
        tokenView.text = store.token().chunked(8).joinToString(" ")
    }

    private fun onToggle() {
        if (StatusBoard.snapshot().serving) TrainingService.stop(this) else TrainingService.start(this)
    }

    override fun onStart() { super.onStart(); StatusBoard.listen(listener) }
    override fun onStop() { StatusBoard.unlisten(listener); super.onStop() }

    private fun render(s: StatusBoard.Snapshot) {
        toggle.text = getString(if (s.serving) R.string.stop else R.string.start)
        statusView.text = if (s.serving) "${s.status} (port ${s.port})" else s.status
        val t = s.history.lastOrNull()
        statsView.text = if (t == null) "no micro-batch yet" else formatStats(t, s.thermalStatus)
        chart.setData(s.history)
    }

    private fun formatStats(t: Telemetry, thermal: Int): String = buildString {
        fun f(x: Double?) = if (x == null) "-" else String.format(Locale.US, "%.4f", x)
        appendLine("stage        ${t.stage}")
        appendLine("window       ${t.window ?: "-"}")
        appendLine("step         ${t.step}")
        appendLine("micro-batch  ${t.microBatch ?: "-"}")
        appendLine("task loss    ${f(t.taskLoss)}")
        appendLine("consis loss  ${f(t.consisLoss)}")
        appendLine("PSS          ${String.format(Locale.US, "%.1f MiB", t.pssBytes / 1048576.0)}")
        appendLine("temperature  ${t.tempC?.let { String.format(Locale.US, "%.1f °C", it) } ?: "-"}  (thermal status $thermal)")
        appendLine("active       ${String.format(Locale.US, "%.1f s", t.activeS)}")
        append("wait         ${String.format(Locale.US, "%.1f s", t.waitS)}")
    }

    /** A minimal line chart of the loss per trained micro-batch. */
    private class LossChart(context: Context) : View(context) {
        private var total = DoubleArray(0)
        private var task = DoubleArray(0)
        private val axis = Paint().apply { color = Color.LTGRAY; strokeWidth = 2f }
        private val black = Paint().apply { color = Color.BLACK; strokeWidth = 3f; isAntiAlias = true }
        private val blue = Paint().apply { color = Color.rgb(33, 150, 243); strokeWidth = 3f; isAntiAlias = true }

        fun setData(h: List<Telemetry>) {
            val trained = h.filter { it.loss != null || it.taskLoss != null }
            total = trained.mapNotNull { it.loss }.toDoubleArray()
            task = trained.mapNotNull { it.taskLoss }.toDoubleArray()
            invalidate()
        }

        override fun onDraw(canvas: Canvas) {
            super.onDraw(canvas)
            val w = width.toFloat(); val h = height.toFloat()
            canvas.drawLine(0f, h - 1, w, h - 1, axis)
            canvas.drawLine(1f, 0f, 1f, h, axis)
            val all = (total + task).filter { it.isFinite() }
            if (all.size < 2) return
            val lo = all.min(); val hi = all.max().let { if (it - lo < 1e-9) lo + 1 else it }
            fun plot(v: DoubleArray, p: Paint) {
                if (v.size < 2) return
                val dx = w / (v.size - 1)
                for (i in 1 until v.size) {
                    if (!v[i - 1].isFinite() || !v[i].isFinite()) continue
                    canvas.drawLine((i - 1) * dx, (h - (v[i - 1] - lo) / (hi - lo) * h).toFloat(), i * dx, (h - (v[i] - lo) / (hi - lo) * h).toFloat(), p)
                }
            }
            plot(total, black)
            plot(task, blue)
        }
    }
}
