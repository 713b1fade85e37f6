package org.zerolock.core.device

import org.zerolock.core.protocol.ConnectionClosedException
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
import org.zerolock.core.protocol.deviceHandshake
import java.io.File
import java.io.IOException
import java.net.InetAddress
import java.net.InetSocketAddress
import java.net.ServerSocket
import java.net.Socket
import java.net.SocketTimeoutException

/** Static facts a device announces in HELLO (and, as TXT, over mDNS). */
class DeviceInfo(
    val name: String,
    val runtimeVersion: String,
    val memoryBytes: Long,
    val capabilities: List<String> = listOf("lora", "replay"),
    val extra: Map<String, Any?> = emptyMap(),
    /** Fields read afresh for every HELLO (`memory_budget_bytes` without a limit: what is available now). */
    val live: () -> Map<String, Any?> = { emptyMap() },
) {
    fun hello(): Message = Messages.hello(name, runtimeVersion, memoryBytes, capabilities, extra + live())
}

/**
 * Builds the chunk runner for an assignment. [filesDir] holds what the host pushed (program,
 * weights, manifest). The Android app returns an ExecuTorch-backed runner.
 */
fun interface RunnerFactory { fun create(assignment: StageAssignment, filesDir: File): ChunkRunner }

/**
 * The device side of ZLWP/1: a TCP server that authenticates the host (one session at a time),
 * then serves the session: STAGE_ASSIGN, file pushes, state, heartbeat, telemetry and
 * CHECKPOINT_COMMITTED. Plain JVM code; the Android TrainingService only starts and stops it.
 *
 * Hidden states never travel on the host session: like zl_mobile's device, STAGE_ASSIGN opens the
 * stage's data port (its [InboundLink], acknowledged as `data_port`), where the upstream stage, or
 * the host's feed for stage 0, connects with the link token (PROTOCOL.md 5.4.1).
 */
class DeviceServer(
    private val info: DeviceInfo,
    token: String,
    private val filesDir: File,
    private val checkpointDir: File,
    private val runners: RunnerFactory,
    private val stats: StatsProvider = StatsProvider { Pair(0L, null) },
    private val listener: StageListener = StageListener {},
    private val log: (String) -> Unit = {},
) : AutoCloseable {
    private val auth = DeviceAuth(token, info.name)
    private var server: ServerSocket? = null
    @Volatile private var hostWriter: FrameWriter? = null
    @Volatile private var hostSocket: Socket? = null
    /** The session of a stage that failed in-app with detect "heartbeat": nothing more is sent on it. */
    @Volatile private var silent: FrameWriter? = null
    /** HEARTBEAT to the host every this many ms while a session is open, as zl-phone's 0.5 s (0: none). */
    var heartbeatPeriodMs: Long = 0
    /** Stage links' shaping (DeviceMain --rate-mbit, --link-delay-ms); the host session is never shaped, as in zl_mobile. */
    var linkShaping: LinkShaping = LinkShaping()
    /** No periodic heartbeat before this System.nanoTime() (hold-gil-in-phase1, [FaultInjector]). */
    @Volatile private var quietUntil = 0L
    @Volatile var stage: StageRuntime? = null
        private set
    private var bindAddress: InetAddress? = null
    /** PROTOCOL.md 5.2: an open transfer with no chunk for this long is dropped (set before [start]). */
    var transferTimeoutMs: Long = FileReceiver.STALE_AFTER_MS
    private val files by lazy { FileReceiver(filesDir, staleAfterMs = transferTimeoutMs) }
    @Volatile private var closed = false
    /** PROTOCOL.md 6: the whole handshake within this long; at most [maxConnections] open at once. */
    var handshakeTimeoutMs: Int = Handshake.HANDSHAKE_TIMEOUT_MS
    /** PROTOCOL.md 6: a frame begun on the session with no byte for this long is a stall (TIMEOUT). */
    var ioTimeoutMs: Int = 10_000
    var maxConnections: Int = 64
    /** At most [maxConnections] open at once; at the cap the oldest unauthenticated gives way (PROTOCOL.md 6). */
    private val slots by lazy { ConnectionSlots(maxConnections) }
    private val watchdog = java.util.concurrent.Executors.newSingleThreadScheduledExecutor { r ->
        Thread(r, "zl-handshake-deadline").also { it.isDaemon = true }
    }

    val port: Int get() = server?.localPort ?: -1

    /** True while a host session holds the device (another host would get BUSY). */
    fun sessionBusy(): Boolean = auth.sessionBusy()

    /** Bind (port 0 = any free port) and serve in background threads. Returns the bound port. */
    fun start(port: Int = 0, bind: InetAddress? = null): Int {
        val s = ServerSocket()
        s.reuseAddress = true
        s.bind(InetSocketAddress(bind, port))
        server = s
        bindAddress = bind
        Thread({ acceptLoop(s) }, "zl-accept").also { it.isDaemon = true; it.start() }
        log("listening on ${s.localSocketAddress}")
        return s.localPort
    }

    private fun acceptLoop(s: ServerSocket) {
        while (!closed) {
            val c = try { s.accept() } catch (e: IOException) {
                if (closed) return
                Thread.sleep(50) // out of descriptors (EMFILE): the connection stays queued; do not spin on it
                continue
            }
            slots.serveOnThread(c, "zl-conn-${c.port}", ::serveSocket)
        }
    }

    private fun serveSocket(sock: Socket) {
        sock.use { c ->
            c.tcpNoDelay = true
            c.keepAlive = true
            val reader = FrameReader(c.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
            val writer = FrameWriter(c.getOutputStream().buffered())
            c.soTimeout = handshakeTimeoutMs
            // one deadline for the whole handshake: a peer trickling a byte now and then never resets it.
            // state: 0 running, 1 done in time, 2 expired (the watchdog said TIMEOUT and cut the input)
            val state = java.util.concurrent.atomic.AtomicInteger(0)
            val timeoutMsg = Messages.error(ErrorCode.TIMEOUT, "handshake not completed within ${handshakeTimeoutMs / 1000.0} s; " +
                "a host authenticates right after it connects")
            val deadline = watchdog.schedule({
                if (state.compareAndSet(0, 2)) {
                    try { writer.write(timeoutMsg) } catch (_: Exception) {}
                    // one ERROR (PROTOCOL.md 2.2, 6): the handshake, cut off mid-frame, must not add TRUNCATED
                    try { c.shutdownOutput() } catch (_: IOException) {}
                    try { c.shutdownInput() } catch (_: IOException) {}
                }
            }, handshakeTimeoutMs.toLong(), java.util.concurrent.TimeUnit.MILLISECONDS)
            try {
                deviceHandshake(reader, writer, auth, info.hello())
                if (!state.compareAndSet(0, 1)) { auth.releaseSession(); return } // too late: the deadline won
                slots.authenticated(c)
            } catch (e: Exception) {
                if (e is SocketTimeoutException && state.compareAndSet(0, 2)) {
                    try { writer.write(timeoutMsg) } catch (_: Exception) {}
                } else if (e is ProtocolException && state.get() != 2) {
                    log("handshake from ${c.remoteSocketAddress} refused: ${e.message}")
                } else if (e !is IOException && e !is ProtocolException) throw e
                return
            } finally {
                deadline.cancel(false)
            }
            log("host session from ${c.remoteSocketAddress}")
            // between frames a host may stay quiet; a frame begun with no byte for ioTimeoutMs is a stall
            c.soTimeout = ioTimeoutMs
            reader.maxFrame = Frames.SESSION_MAX_FRAME // what a session can need (PROTOCOL.md 2.1)
            hostWriter = writer
            hostSocket = c
            val open = java.util.concurrent.atomic.AtomicBoolean(true)
            if (heartbeatPeriodMs > 0) {
                Thread({ heartbeats(writer, open) }, "zl-heartbeat").also { it.isDaemon = true; it.start() }
            }
            try {
                session(reader, writer)
            } catch (e: ProtocolException) {
                log("session error: ${e.message}")
                try { writer.write(e.toMessage()) } catch (_: Exception) {}
            } catch (_: ConnectionClosedException) {
            } catch (e: IOException) {
                log("session I/O: ${e.message}")
            } finally {
                open.set(false)
                if (hostWriter === writer) { hostWriter = null; hostSocket = null }
                files.abortAll()
                auth.releaseSession()
                log("host session ended")
            }
        }
    }

    /** The device's own HEARTBEATs on the session, as zl_mobile's device sends them, until it ends or goes silent. */
    private fun heartbeats(writer: FrameWriter, open: java.util.concurrent.atomic.AtomicBoolean) {
        var seq = 0L
        while (open.get() && writer !== silent) {
            if (System.nanoTime() >= quietUntil) {
                try { writer.write(Messages.heartbeat(seq++, System.nanoTime() / 1_000_000)) } catch (_: IOException) { return }
            }
            Thread.sleep(heartbeatPeriodMs)
        }
    }

    /**
     * An injected in-app failure dropped [rt] (mode "app", zl_mobile's Device._stage_failed): the
     * device forgets the stage and the host learns of it as of an app whose training crashed: the
     * session is closed (`connection`), or nothing more is sent on it, heartbeats included, until
     * the host's heartbeat timeout gives up on it (`heartbeat`). The device itself serves on; the
     * host reconnects and a new STAGE_ASSIGN restores the stage from its checkpoint.
     */
    private fun stageFailed(rt: StageRuntime, detect: String) {
        synchronized(this) { if (stage === rt) stage = null }
        val w = hostWriter ?: return
        if (detect == "heartbeat") silent = w else try { hostSocket?.close() } catch (_: IOException) {}
    }

    private fun session(reader: FrameReader, out: FrameWriter) {
        val writer = object { fun write(m: Message) { if (out !== silent) out.write(m) } }
        while (true) {
            val m = try { reader.read() } catch (_: SocketTimeoutException) { files.sweep(); continue }
            files.sweep() // counted from each transfer's last chunk, heartbeats or not
            if (m.type == MsgType.ERROR) { // about the session (no request_id): it ends (5.1); about one request: go on
                log("host reported ${Quote.quote(m.string("code"))}: ${Quote.quote(m.string("message"))}")
                if (m.meta["request_id"] == null) return
                continue
            }
            try {
                handle(m, writer::write)
            } catch (e: ProtocolException) {
                // PROTOCOL.md 5.1: an ERROR about one request carries its request_id and the session
                // goes on; one about no request (the message had none) ends it
                val rid = e.requestId ?: requestIdOf(m) ?: throw e
                log("${m.type} refused: ${e.message}")
                writer.write(Messages.error(e.code, e.detail, rid))
            } catch (e: RuntimeException) { // a failure on this side (INTERNAL), as zl-phone's
                val rid = requestIdOf(m)
                val err = ProtocolException(ErrorCode.INTERNAL, "${m.type} failed on the device: ${e.javaClass.simpleName}: ${e.message}", rid)
                log(err.message ?: "")
                if (rid == null) throw err
                writer.write(err.toMessage())
            }
            if (m.type == MsgType.SHUTDOWN) return
        }
    }

    /** The message's `request_id` when it carries a uint one (ACK, STATE_GET, ...), else null. */
    private fun requestIdOf(m: Message): Long? = (m.meta["request_id"] as? Long)?.takeIf { it >= 0 }

    /** One host message other than ERROR; a refusal is a [ProtocolException]. */
    private fun handle(m: Message, write: (Message) -> Unit) {
        when (m.type) {
            MsgType.HEARTBEAT -> write(Messages.heartbeat(m.long("seq"), System.nanoTime() / 1_000_000))
            MsgType.STAGE_ASSIGN -> write(assign(m))
            MsgType.STATE_GET -> write(requireStage(m).state(m.string("kind"), m.long("request_id")))
            MsgType.STATE_PUT -> write(Messages.ack(m.long("request_id"), false, "STATE_PUT is not supported by this device yet; the adapter starts from its checkpoint or from init"))
            MsgType.FILE_BEGIN, MsgType.FILE_CHUNK, MsgType.FILE_END -> files.onMessage(m)?.let(write)
            MsgType.SHUTDOWN -> stopStage()
            else -> throw ProtocolException(ErrorCode.UNEXPECTED, "${m.type} is not something a host sends to a device" +
                if (m.type == MsgType.HIDDEN_STATE) "; hidden states go to the stage's data_port (PROTOCOL.md 5.4.1)" else "")
        }
    }

    private fun requireStage(m: Message): StageRuntime =
        stage ?: throw ProtocolException(ErrorCode.UNEXPECTED, "${m.type} before STAGE_ASSIGN; assign a stage first")

    @Synchronized
    private fun assign(m: Message): Message {
        val a = StageAssignment(m)
        val rid = m.long("request_id")
        try {
            a.check()
        } catch (e: ProtocolException) {
            return Messages.error(ErrorCode.REJECTED, e.detail, rid)
        }
        val cur = stage
        if (cur != null && !a.restart && cur.assignment.runId == a.runId && cur.assignment.stage == a.stage) {
            cur.rewire(a.downstream) // a neighbour restarted: keep the running stage and its state
            log("stage ${a.stage} rewired: downstream ${a.downstream}")
            return assignAck(rid, cur)
        }
        // a fixed listen_port is bound before the running stage stops: one that cannot be had is
        // refused with nothing stopped or created (PROTOCOL.md 5.3.1); the running stage's own port
        // is bound again by the new stage once the old one closed it
        val port = a.listenPort
        val bound = if (port == 0 || cur?.dataPort == port) null else try { bindListener(bindAddress, port) } catch (e: IOException) {
            return Messages.error(ErrorCode.REJECTED, "STAGE_ASSIGN listen_port: cannot listen on port $port (${e.message}); " +
                "free the port or assign another", rid)
        }
        stopStage()
        val runner = try { runners.create(a, filesDir) } catch (e: Exception) {
            try { bound?.close() } catch (_: IOException) {}
            return Messages.error(ErrorCode.REJECTED, "cannot load the chunk program: ${e.message}", rid)
        }
        val rt = try {
            StageRuntime(a, runner, checkpointDir, { hostWriter?.takeIf { it !== silent } }, stats, listener, bindAddress, log, bound,
                onFailure = ::stageFailed, quiet = { ms -> quietUntil = System.nanoTime() + ms * 1_000_000 }, shaping = linkShaping)
        } catch (e: Exception) {
            runner.close()
            try { bound?.close() } catch (_: IOException) {}
            return Messages.error(ErrorCode.REJECTED, "cannot start stage ${a.stage}: ${e.message}", rid)
        }
        stage = rt
        log("assigned stage ${a.stage}/${a.numStages}, W=${a.windowSize} D=${a.inflightDepth} horizon=${a.replayHorizon}, " +
            "data port ${rt.dataPort}, next micro-batch ${rt.nextMicroBatch}")
        return assignAck(rid, rt)
    }

    /** ACK of STAGE_ASSIGN: where the upstream link connects and where the stage resumes. */
    private fun assignAck(rid: Long, rt: StageRuntime): Message = Message(MsgType.ACK, linkedMapOf(
        "request_id" to rid, "ok" to true, "data_port" to rt.dataPort,
        "committed_window" to rt.committedWindow, "next_micro_batch" to rt.nextMicroBatch))

    @Synchronized
    private fun stopStage() {
        stage?.stop(); stage = null
    }

    override fun close() {
        closed = true
        watchdog.shutdownNow()
        stopStage()
        try { server?.close() } catch (_: IOException) {}
    }
}
