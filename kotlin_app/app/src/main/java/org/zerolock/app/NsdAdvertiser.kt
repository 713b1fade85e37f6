package org.zerolock.app

import android.content.Context
import android.net.nsd.NsdManager
import android.net.nsd.NsdServiceInfo
import android.util.Log
import org.zerolock.core.ZeroLockService
import org.zerolock.core.ZeroLockTxt

/** Advertises this phone as `_zerolock._tcp` with the ZeroLock TXT record (NsdManager). */
class NsdAdvertiser(context: Context) {
    private val nsd = context.getSystemService(Context.NSD_SERVICE) as NsdManager
    private var listener: NsdManager.RegistrationListener? = null

    /**
     * Registers the service, or registers nothing and returns why (one line, for the status screen):
     * a name that is not one DNS label of <= 63 bytes of UTF-8 without control characters
     * (docs/PROTOCOL.md 10.2), by the core's rule, the one zl-phone and the host's TXT check apply.
     * Dots are fine here: NsdManager writes the whole name as one label (NsdManager renames a taken
     * one "NAME (2)" itself, as zl_mobile does).
     */
    fun register(port: Int, txt: ZeroLockTxt): String? {
        unregister()
        ZeroLockService.instanceNameRefusal(txt.name)?.let {
            val line = "$it: not advertised over mDNS; connect over adb or by address"
            Log.w(TAG, line)
            return line
        }
        val info = NsdServiceInfo().apply {
            serviceName = txt.name
            serviceType = SERVICE_TYPE
            setPort(port)
            for ((k, v) in txt.toAttributes()) setAttribute(k, v)
        }
        // block bodies: Log.i/w return int, the listener's methods return void
        val l = object : NsdManager.RegistrationListener {
            override fun onServiceRegistered(si: NsdServiceInfo) { Log.i(TAG, "advertised ${si.serviceName} on port $port") }
            override fun onRegistrationFailed(si: NsdServiceInfo, errorCode: Int) { Log.w(TAG, "mDNS registration failed ($errorCode); pair over adb instead") }
            override fun onServiceUnregistered(si: NsdServiceInfo) { Log.i(TAG, "mDNS advertisement withdrawn") }
            override fun onUnregistrationFailed(si: NsdServiceInfo, errorCode: Int) { Log.w(TAG, "mDNS unregistration failed ($errorCode)") }
        }
        listener = l
        nsd.registerService(info, NsdManager.PROTOCOL_DNS_SD, l)
        return null
    }

    fun unregister() {
        listener?.let { runCatching { nsd.unregisterService(it) } }
        listener = null
    }

    companion object {
        const val SERVICE_TYPE = ZeroLockService.TYPE
        private const val TAG = "ZeroLockNsd"
    }
}
