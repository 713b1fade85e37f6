package org.zerolock.app

import android.app.Notification
import android.app.NotificationChannel
import android.app.NotificationManager
import android.app.PendingIntent
import android.app.Service
import android.content.Context
import android.content.Intent
import android.content.pm.ServiceInfo
import android.net.wifi.WifiManager
import android.os.Build
import android.os.IBinder
import android.os.PowerManager
import android.util.Log
import org.zerolock.core.ZeroLockTxt
import org.zerolock.core.device.DeviceInfo
import org.zerolock.core.device.DeviceServer
import org.zerolock.core.device.ManifestRunnerFactory
import org.zerolock.core.device.StageListener

/**
 * Foreground service that serves the host (ZLWP/1 via the core's DeviceServer), so training
 * continues with the screen off. Holds a partial wake lock and a Wi-Fi lock while serving.
 */
class TrainingService : Service() {
    private var server: DeviceServer? = null
    private var nsd: NsdAdvertiser? = null
    private var wakeLock: PowerManager.WakeLock? = null
    private var wifiLock: WifiManager.WifiLock? = null

    override fun onBind(intent: Intent?): IBinder? = null

    override fun onStartCommand(intent: Intent?, flags: Int, startId: Int): Int {
        if (intent?.action == ACTION_STOP) { stopSelf(); return START_NOT_STICKY }
        if (Build.VERSION.SDK_INT >= 34) {
            startForeground(NOTIFICATION_ID, notification(), ServiceInfo.FOREGROUND_SERVICE_TYPE_SPECIAL_USE)
        } else {
            startForeground(NOTIFICATION_ID, notification())
        }
        if (server == null) startServing(intent?.getIntExtra(EXTRA_PORT, DEFAULT_PORT) ?: DEFAULT_PORT)
        return START_STICKY
    }

    private fun startServing(port: Int) {
        val store = CheckpointStore(this)
        val stats = DeviceStats(this)
        val name = "${Build.MANUFACTURER} ${Build.MODEL}".trim()
        val info = DeviceInfo(
            name = name,
            runtimeVersion = RUNTIME_VERSION,
            memoryBytes = stats.totalMemBytes(),
            capabilities = listOf("executorch", "xnnpack", "lora", "replay"),
            extra = mapOf("model" to Build.MODEL, "os" to "Android ${Build.VERSION.RELEASE}",
                "abi" to (Build.SUPPORTED_ABIS.firstOrNull() ?: "unknown"), "cores" to Runtime.getRuntime().availableProcessors(),
                "memory_budget_bytes" to stats.memoryBudgetBytes()),
        )
        val srv = DeviceServer(
            info = info,
            token = store.token(),
            filesDir = store.programsDir,
            checkpointDir = store.checkpointsDir,
            runners = ManifestRunnerFactory { program, weights -> ChunkProgram.load(program, weights) },
            stats = stats,
            listener = StageListener { t -> StatusBoard.onTelemetry(t, stats.thermalStatus()) },
            log = { Log.i(TAG, it) },
        )
        val bound = try {
            srv.start(port)
        } catch (e: java.io.IOException) {
            Log.w(TAG, "port $port busy (${e.message}); using any free port")
            srv.start(0)
        }
        server = srv
        wakeLock = (getSystemService(Context.POWER_SERVICE) as PowerManager)
            .newWakeLock(PowerManager.PARTIAL_WAKE_LOCK, "zerolock:training").apply { acquire() }
        @Suppress("DEPRECATION")
        wifiLock = (applicationContext.getSystemService(Context.WIFI_SERVICE) as WifiManager)
            .createWifiLock(WifiManager.WIFI_MODE_FULL_HIGH_PERF, "zerolock:link").apply { acquire() }
        val unadvertised = NsdAdvertiser(this).let { a ->
            nsd = a
            a.register(bound, ZeroLockTxt(name = name, proto = ZeroLockService.PROTO, runtime = RUNTIME_VERSION, memBytes = stats.totalMemBytes()))
        }
        StatusBoard.update { it.copy(serving = true, port = bound, status = "waiting for the host on port $bound" + (unadvertised?.let { u -> "; $u" } ?: "")) }
    }

    override fun onDestroy() {
        nsd?.unregister(); nsd = null
        server?.close(); server = null
        wifiLock?.let { if (it.isHeld) it.release() }; wifiLock = null
        wakeLock?.let { if (it.isHeld) it.release() }; wakeLock = null
        StatusBoard.update { it.copy(serving = false, port = -1, status = "stopped") }
        super.onDestroy()
    }

    private fun notification(): Notification {
        val nm = getSystemService(NotificationManager::class.java)
        nm.createNotificationChannel(NotificationChannel(CHANNEL, getString(R.string.channel_name), NotificationManager.IMPORTANCE_LOW))
        val open = PendingIntent.getActivity(this, 0, Intent(this, MainActivity::class.java), PendingIntent.FLAG_IMMUTABLE)
        val stop = PendingIntent.getService(this, 1, Intent(this, TrainingService::class.java).setAction(ACTION_STOP), PendingIntent.FLAG_IMMUTABLE)
        return Notification.Builder(this, CHANNEL)
            .setSmallIcon(R.drawable.ic_zerolock)
            .setContentTitle(getString(R.string.notification_title))
            .setContentIntent(open)
            .addAction(Notification.Action.Builder(null, getString(R.string.stop), stop).build())
            .setOngoing(true)
            .build()
    }

    companion object {
        const val DEFAULT_PORT = 47474
        const val EXTRA_PORT = "port"
        const val ACTION_STOP = "org.zerolock.app.STOP"
        const val RUNTIME_VERSION = "executorch-android 1.0.1"
        private const val CHANNEL = "training"
        private const val NOTIFICATION_ID = 1
        private const val TAG = "ZeroLock"

        fun start(context: Context) = context.startForegroundService(Intent(context, TrainingService::class.java))
        fun stop(context: Context) = context.startService(Intent(context, TrainingService::class.java).setAction(ACTION_STOP))
    }
}
