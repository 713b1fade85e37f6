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

    fun register(port: Int, txt: ZeroLockTxt) {
        unregister()
        // docs/PROTOCOL.md 10.2: the instance name is one DNS label of <= 63 bytes (NsdManager renames
        // a taken one "NAME (2)" itself, as zl_mobile does)
        ZeroLockService.instanceNameProblem(txt.name)?.let {
            Log.w(TAG, "device name '${txt.name}' $it: not advertised over mDNS; choose a shorter name, or pair over adb")
            return
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
