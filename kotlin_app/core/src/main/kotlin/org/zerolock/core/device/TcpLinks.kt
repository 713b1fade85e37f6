package org.zerolock.core.device

import org.zerolock.core.InboundCredits
import org.zerolock.core.InboundQueue
import org.zerolock.core.LinkRules
import org.zerolock.core.OutboundLinkState
import org.zerolock.core.protocol.DeviceAuth
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Quote
import org.zerolock.core.protocol.RateLimiter
import org.zerolock.core.protocol.deviceHandshake
import org.zerolock.core.protocol.hostHandshake
import java.io.IOException
import java.net.InetAddress
import java.net.InetSocketAddress
import java.net.ServerSocket
import java.net.Socket

/**
 * Stage-to-stage hidden-state links over TCP (PROTOCOL.md 5.4.1), the Kotlin twin of
 * zl_mobile/links.py; the rules themselves are in LinkRules.kt ([OutboundLinkState], [InboundCredits],
 * [InboundQueue]), as in zl_mobile/link_rules.py.
 *
 * OutboundLink (upstream side, the TCP client, "host" of the link handshake with the link's token):
 * keeps every hidden state it produced until the downstream commits the window that used it (the
 * stage waits in [OutboundLink.waitForRoom] while the buffer holds its replay horizon) and sends them in micro-batch order as the downstream
 * grants credits. On (re)connection the downstream first says which micro-batch it needs next.
 */
class OutboundLink(
    val name: String,
    private val token: String,
    windowSize: Int,
    replayHorizon: Int,
    pruneOnCommit: Boolean = true,
    private val onError: (String) -> Unit = {},
    private val onCommitted: (Map<String, Any?>) -> Unit = {},
    private val log: (String) -> Unit = {},
    /** What the downstream may send (GRADIENT at most): [LinkRules.linkFrameLimit]. */
    private val maxFrame: Long = Frames.DEFAULT_MAX_FRAME,
    /** A frame begun with no byte for this long is a stall (TIMEOUT); quiet between frames is fine. */
    private val stallMs: Int = LinkRules.STALL_MS,
    /** The buffer's on-disk copy ([ReplayStore]); a restarted stage reloads what it had sent below [firstMb]. */
    private val store: ReplayStore? = null,
    firstMb: Long = 0,
    /** Paces what this link sends (DeviceMain --rate-mbit, zl-phone's); null: unshaped. */
    private val limiter: RateLimiter? = null,
    /** What the downstream sends is seen this much later (--link-delay-ms), so the credit loop pays it too. */
    private val delay: DelayLine? = null,
) : AutoCloseable {
    private val lock = Object()
    private val state = OutboundLinkState<Message>(name, windowSize, replayHorizon, pruneOnCommit).also { st ->
        store?.let { st.restore(it.load(firstMb).map { m -> m.long("micro_batch") to m }, firstMb) }
    }
    private var address: String? = null
    private var sock: Socket? = null
    private var stopped = false
    private var failedAddress: String? = null
    @Volatile var framesSent: Long = 0
        private set
    @Volatile var bytesSent: Long = 0
        private set
    val downstreamCommitted: Long get() = synchronized(lock) { state.downstreamCommitted }

    private val thread = Thread({ run() }, "zl-out-$name").also { it.isDaemon = true; it.start() }

    /** Where the downstream's data port is ("host:port"); a new address drops the connection. */
    fun setAddress(a: String?) = synchronized(lock) {
        if (a != address) {
            address = a
            closeQuietly(sock)
        }
        lock.notifyAll()
    }

    fun publish(m: Message) = synchronized(lock) {
        state.publish(m.long("micro_batch"), m)
        lock.notifyAll()
    }

    fun buffered(): List<Long> = synchronized(lock) { state.buffered() }

    /** Writes a published hidden state to the on-disk copy (after it was handed to the sender,
     *  so early forwarding does not wait for the disk). */
    fun persist(m: Message) {
        if (store != null && synchronized(lock) { m.long("micro_batch") in state }) store.put(m) // not if committed meanwhile
    }

    /** Before the stage commits a checkpoint: its window's hidden states are durable first. */
    fun sync() { store?.sync() }

    /** Backpressure: block while the replay buffer holds its bound (until the downstream commits
     *  a window) or until [stop]; returns the nanoseconds waited. */
    fun waitForRoom(stop: () -> Boolean): Long {
        val t0 = System.nanoTime()
        synchronized(lock) {
            while (state.full() && !stopped && !stop()) lock.wait(200)
        }
        return System.nanoTime() - t0
    }

    override fun close() {
        synchronized(lock) { stopped = true; closeQuietly(sock); lock.notifyAll() }
        thread.join(2000)
    }

    private fun run() {
        while (true) {
            val addr = synchronized(lock) {
                while (!stopped && address == null) lock.wait()
                if (stopped) return
                address!!
            }
            val s = Socket()
            val reader: FrameReader
            val writer: FrameWriter
            try {
                s.connect(InetSocketAddress(addr.substringBeforeLast(':'), addr.substringAfterLast(':').toInt()), 2000)
                s.tcpNoDelay = true
                s.soTimeout = Handshake.HANDSHAKE_TIMEOUT_MS
                reader = FrameReader(s.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
                writer = FrameWriter(s.getOutputStream().buffered(), limiter)
                hostHandshake(reader, writer, token, name)
                s.soTimeout = stallMs
                reader.maxFrame = maxFrame
            } catch (e: Exception) { // I/O, handshake refused, bad address: the neighbour may be restarting
                closeQuietly(s)
                if (addr != failedAddress) { failedAddress = addr; log("$name: connecting to $addr failed (${e.message}); retrying") }
                Thread.sleep(200)
                continue
            }
            failedAddress = null
            synchronized(lock) {
                if (stopped || addr != address) { closeQuietly(s); return@synchronized null }
                sock = s
                state.connected()
                s
            } ?: continue
            val readerThread = Thread({ read(s, reader, writer) }, "zl-out-read-$name").also { it.isDaemon = true; it.start() }
            try {
                sendLoop(s, writer)
            } catch (e: IOException) {
                log("$name: link to $addr dropped (${e.message})")
            } finally {
                closeQuietly(s)
                synchronized(lock) {
                    if (sock === s) { sock = null; state.disconnected() }
                    lock.notifyAll()
                }
                readerThread.join(1000)
            }
        }
    }

    private fun sendLoop(s: Socket, w: FrameWriter) {
        while (true) {
            val m = synchronized(lock) {
                while (!stopped && !s.isClosed && !state.sendable()) lock.wait(500)
                if (stopped || s.isClosed) return
                state.takeNext()!!.second
            }
            val bytes = w.write(m) // the frame's size, from the one encode that sends it
            framesSent += 1
            bytesSent += bytes
        }
    }

    private fun read(s: Socket, r: FrameReader, w: FrameWriter) {
        try {
            while (true) {
                val m = try { r.read() } catch (_: java.net.SocketTimeoutException) { continue } // quiet between frames
                if (delay == null) handle(s, m) else delay.deliver {
                    try { handle(s, m) } catch (e: ProtocolException) { fail(s, w, e) } // from the delay line's thread
                }
            }
        } catch (e: ProtocolException) { // a bad frame (CREDIT 0, from > to), a stall or a lie: say so, then close
            fail(s, w, e)
        } catch (_: Exception) {
        } finally {
            closeQuietly(s)
            synchronized(lock) { lock.notifyAll() }
        }
    }

    /** A downstream that broke the link's rules: ERROR to it, then the connection closes. */
    private fun fail(s: Socket, w: FrameWriter, e: ProtocolException) {
        log("$name: downstream link error: ${e.message}")
        try { w.write(e.toMessage()) } catch (_: Exception) {}
        closeQuietly(s)
        synchronized(lock) { lock.notifyAll() }
    }

    /** One frame from the downstream, on connection [s]. */
    private fun handle(s: Socket, m: Message) {
                var error: String? = null
                var committed: Map<String, Any?>? = null
                synchronized(lock) {
                    val current = sock === s // a delayed credit or request of a dropped connection is void (as zl_mobile/links.py)
                    when (m.type) {
                        MsgType.CREDIT -> if (current) state.onCredit(m.long("credits"))
                        MsgType.REPLAY_REQUEST -> if (current) error = state.onReplayRequest(m.long("from_micro_batch"))
                        MsgType.CHECKPOINT_COMMITTED -> {
                            // a commit past what was sent on this link is a lie: ERROR, nothing pruned
                            state.onCommitted(m.long("window"))?.let { throw ProtocolException(ErrorCode.UNEXPECTED, it) }
                            committed = m.meta
                            store?.dropBelow(LinkRules.windowEnd(m.long("window"), state.windowSize))
                        }
                        MsgType.ERROR -> log("$name: downstream error ${Quote.quote(m.string("code"))}: ${Quote.quote(m.string("message"))}")
                        else -> log("$name: ignored ${m.type} from downstream")
                    }
                    lock.notifyAll()
                }
                error?.let(onError) // never silently skipped
                committed?.let(onCommitted)
    }
}

/** A device's stage-link shaping, shared by all its links (one limiter shapes their sum, as zl-phone's). */
class LinkShaping(val limiter: RateLimiter? = null, val delay: DelayLine? = null)

/**
 * Hands each arriving frame on [delayMs] after it arrived, in arrival order, without holding up
 * the receiving thread: the one-way latency of an emulated phone's link (--link-delay-ms), as
 * zl_mobile/links.py's DelayLine. Frames keep arriving at the link's rate; each is seen later.
 */
class DelayLine(val delayMs: Double, private val log: (String) -> Unit = {}) {
    init { require(delayMs >= 0) { "link delay must be >= 0 ms, got $delayMs" } }
    private val items = ArrayDeque<Pair<Long, () -> Unit>>()
    private val lock = Object()

    init {
        Thread({ run() }, "zl-link-delay").also { it.isDaemon = true; it.start() }
    }

    fun deliver(action: () -> Unit) = synchronized(lock) {
        items.addLast(System.nanoTime() + (delayMs * 1e6).toLong() to action)
        lock.notifyAll()
    }

    private fun run() {
        while (true) {
            val (due, action) = synchronized(lock) {
                while (items.isEmpty()) lock.wait()
                items.removeFirst()
            }
            val waitNs = due - System.nanoTime()
            if (waitNs > 0) Thread.sleep(waitNs / 1_000_000, (waitNs % 1_000_000).toInt())
            try {
                action()
            } catch (e: Exception) { // a consumer's failure must not stop later deliveries
                log("link delay: delivering a frame failed: $e")
            }
        }
    }
}

/**
 * Downstream side (the TCP server, "device" of the link handshake with the link's token): accepts
 * one upstream at a time, announces its resume point (REPLAY_REQUEST from [nextNeeded]), grants
 * the initial credits (inflight_depth - queued), and puts HIDDEN_STATE frames into [queue].
 */
class InboundLink(
    val name: String,
    token: String,
    private val queue: InboundQueue<Message>,
    private val inflightDepth: Int,
    private val nextNeeded: () -> Long,
    port: Int = 0,
    bind: InetAddress? = null,
    private val log: (String) -> Unit = {},
    /** A listening socket bound already (the device binds a fixed listen_port before it stops the running stage). */
    listener: ServerSocket? = null,
    /** The largest frame the upstream may send: [LinkRules.linkFrameLimit] of the chunk. */
    private val maxFrame: Long = Frames.DEFAULT_MAX_FRAME,
    /** A frame begun with no byte for this long is a stall (TIMEOUT, PROTOCOL.md 6). */
    private val stallMs: Int = LinkRules.STALL_MS,
    /** Why the stage can never use this HIDDEN_STATE (null: it can); checked before it is kept. */
    private val unusable: (Message) -> String? = { null },
    /** Hidden states are queued this much after they arrived (--link-delay-ms); null: at once. */
    private val delay: DelayLine? = null,
    /** PROTOCOL.md 6: connections open at once on this port; at the cap the oldest unauthenticated gives way. */
    private val maxConnections: Int = LinkRules.MAX_CONNECTIONS,
) : AutoCloseable {
    private val auth = DeviceAuth(token, name)
    private val slots = ConnectionSlots(maxConnections)
    private val server = listener ?: bindListener(bind, port)
    private val creditLock = Object()
    /** The current upstream connection's credits (5.4.1: the downstream enforces them); null: none connected. */
    private var credits: InboundCredits? = null
    val port: Int = server.localPort
    @Volatile private var writer: FrameWriter? = null
    @Volatile private var current: Socket? = null
    @Volatile var bytesReceived: Long = 0
        private set

    private val acceptThread = Thread({
        while (!server.isClosed) {
            val c = try { server.accept() } catch (_: IOException) {
                if (server.isClosed) break
                Thread.sleep(50) // out of descriptors (EMFILE): the peer stays queued; do not spin
                continue
            }
            slots.serveOnThread(c, "zl-in-$name", ::serve) // at the cap the oldest unauthenticated gives way
        }
    }, "zl-in-accept-$name").also { it.isDaemon = true; it.start() }

    private fun serve(sock: Socket) = sock.use { c ->
        c.tcpNoDelay = true
        val r = FrameReader(c.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
        val w = FrameWriter(c.getOutputStream().buffered())
        c.soTimeout = Handshake.HANDSHAKE_TIMEOUT_MS
        try {
            deviceHandshake(r, w, auth, Messages.hello(name, "kotlin-core", 0, listOf("link")))
        } catch (e: Exception) {
            log("$name: refused an upstream link: ${e.message}")
            return@use
        }
        slots.authenticated(c)
        c.soTimeout = stallMs
        r.maxFrame = maxFrame
        val connCredits = InboundCredits(name) // counted per connection: a new upstream starts with none
        synchronized(creditLock) { credits = connCredits; writer = w; current = c }
        try {
            w.write(Message(MsgType.REPLAY_REQUEST, linkedMapOf("from_micro_batch" to nextNeeded(), "to_micro_batch" to LinkRules.NO_END)))
            LinkRules.initialCredit(inflightDepth, queue.size)?.let {
                synchronized(creditLock) { connCredits.grant(it) }
                w.write(Messages.credit(it))
            }
            // as zl_mobile: a new upstream (a restarted one reloading its replay buffer) learns what
            // this stage committed, and prunes what it holds for it
            lastCommit?.let { w.write(it) }
            while (true) {
                val m = try { r.read() } catch (_: java.net.SocketTimeoutException) { continue } // an upstream without credits is quiet
                if (m.type != MsgType.HIDDEN_STATE) {
                    throw ProtocolException(ErrorCode.UNEXPECTED, "${m.type} on a hidden-state link; only HIDDEN_STATE is sent downstream")
                }
                val mb = m.long("micro_batch")
                // checked before it is kept: a frame past the credits, or one the stage cannot use, is never queued
                synchronized(creditLock) { connCredits.spend(mb) }?.let { throw ProtocolException(ErrorCode.UNEXPECTED, it) }
                unusable(m)?.let { throw ProtocolException(ErrorCode.UNEXPECTED, LinkRules.unusableMessage(mb, name, it)) }
                bytesReceived += m.tensors.values.sumOf { it.data.size.toLong() }
                if (delay == null) queue.put(mb, m) else delay.deliver { queue.put(mb, m) }
            }
        } catch (e: ProtocolException) {
            log("$name: upstream link error: ${e.message}")
            try { w.write(e.toMessage()) } catch (_: Exception) {}
        } catch (_: IOException) {
        } finally {
            synchronized(creditLock) { if (writer === w) { writer = null; current = null; credits = null } }
            auth.releaseSession()
        }
    }

    /** Return [n] credits upstream as queue entries are consumed. */
    fun grant(n: Long = 1, microBatch: Long? = null) {
        synchronized(creditLock) {
            val c = credits ?: return // no upstream connected
            c.grant(n) // counted before it is sent: the frame it allows may come back at once
        }
        trySend(Messages.credit(n, microBatch))
    }

    /** This stage's last CHECKPOINT_COMMITTED, re-announced on every new upstream connection. */
    @Volatile var lastCommit: Message? = null

    /** Tell the upstream that windows <= [window] are durably used: it may prune them. */
    fun committed(window: Long, step: Long, sha256: String) {
        val m = Message(MsgType.CHECKPOINT_COMMITTED, linkedMapOf("window" to window, "step" to step, "sha256" to sha256))
        lastCommit = m
        trySend(m)
    }

    private fun trySend(m: Message) {
        val w = writer ?: return
        try { w.write(m) } catch (_: IOException) { closeQuietly(current) }
    }

    override fun close() {
        try { server.close() } catch (_: IOException) {}
        closeQuietly(current)
        // the JDK releases a listening socket closed under a blocked accept() only when that
        // thread leaves accept(): wait for it, so the next stage can bind the same listen_port
        if (Thread.currentThread() !== acceptThread) acceptThread.join(2000)
    }
}

internal fun closeQuietly(s: Socket?) { try { s?.close() } catch (_: IOException) {} }

/** A stage's data port. SO_REUSEADDR: a fixed port (USB phones) is bound again right after the
 *  stage that held it closed, its old connections in TIME_WAIT. */
fun bindListener(bind: InetAddress?, port: Int): ServerSocket {
    val s = ServerSocket()
    try {
        s.reuseAddress = true
        s.bind(InetSocketAddress(bind, port))
    } catch (e: IOException) {
        try { s.close() } catch (_: IOException) {}
        throw e
    }
    return s
}
