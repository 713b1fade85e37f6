package org.zerolock.core.device

import java.io.IOException
import java.net.Socket
import java.util.concurrent.Semaphore
import java.util.concurrent.TimeUnit

/**
 * PROTOCOL.md 6: a listening port's cap on open connections, one rule for the host port
 * ([DeviceServer]) and a stage's data port ([InboundLink]). At the cap the oldest connection that
 * has not authenticated gives way (its handshake fails and its slot frees), so idle sockets cannot
 * keep a real peer out; with none to evict, the new connection is closed.
 */
internal class ConnectionSlots(max: Int) {
    private val slots = Semaphore(max)
    /** Admitted connections not yet authenticated, oldest first. */
    private val unauthenticated = LinkedHashMap<Socket, Unit>()

    /** Serve [c] on a thread of its own if a slot can be had (its slot freed when [serve] returns);
     *  otherwise close it. */
    fun serveOnThread(c: Socket, threadName: String, serve: (Socket) -> Unit) {
        if (!slots.tryAcquire() && !(evictUnauthenticated() && slots.tryAcquire(2, TimeUnit.SECONDS))) {
            closeQuietly(c)
            return
        }
        synchronized(unauthenticated) { unauthenticated[c] = Unit }
        try {
            Thread({ try { serve(c) } finally { release(c) } }, threadName).also { it.isDaemon = true; it.start() }
        } catch (e: OutOfMemoryError) { // no thread to be had
            release(c)
            closeQuietly(c)
        }
    }

    /** [c] passed its handshake: no longer the one to give way at the cap. */
    fun authenticated(c: Socket) {
        synchronized(unauthenticated) { unauthenticated.remove(c) }
    }

    private fun release(c: Socket) {
        authenticated(c)
        slots.release()
    }

    private fun evictUnauthenticated(): Boolean {
        val victim = synchronized(unauthenticated) {
            val it = unauthenticated.keys.iterator()
            if (!it.hasNext()) return false
            it.next().also { _ -> it.remove() }
        }
        try { victim.shutdownInput() } catch (_: IOException) {}
        closeQuietly(victim)
        return true
    }

    private fun closeQuietly(s: Socket) {
        try { s.close() } catch (_: IOException) {}
    }
}
