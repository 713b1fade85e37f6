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
) {
    fun hello(): Message = Messages.hello(name, runtimeVersion, memoryBytes, capabilities, extra)
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
    @Volatile var stage: StageRuntime? = null
        private set
    private var bindAddress: InetAddress? = null
    private val files = FileReceiver(filesDir)
    @Volatile private var closed = false
    /** PROTOCOL.md 6: the whole handshake within this long; at most [maxConnections] open at once. */
    var handshakeTimeoutMs: Int = Handshake.HANDSHAKE_TIMEOUT_MS
    var maxConnections: Int = 64
    private val slots by lazy { java.util.concurrent.Semaphore(maxConnections) }
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
            if (!slots.tryAcquire()) { // too many open at once: close this one (PROTOCOL.md 6)
                try { c.close() } catch (_: IOException) {}
                continue
            }
            try {
                Thread({ try { serve(c) } finally { slots.release() } }, "zl-conn-${c.port}").also { it.isDaemon = true; it.start() }
            } catch (e: OutOfMemoryError) { // no thread to be had
                slots.release()
                try { c.close() } catch (_: IOException) {}
            }
        }
    }

    private fun serve(sock: Socket) {
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
                    try { c.shutdownInput() } catch (_: IOException) {}
                }
            }, handshakeTimeoutMs.toLong(), java.util.concurrent.TimeUnit.MILLISECONDS)
            try {
                deviceHandshake(reader, writer, auth, info.hello())
                if (!state.compareAndSet(0, 1)) { auth.releaseSession(); return } // too late: the deadline won
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
            c.soTimeout = 0
            reader.maxFrame = Frames.DEFAULT_MAX_FRAME
            hostWriter = writer
            try {
                session(reader, writer)
            } catch (e: ProtocolException) {
                log("session error: ${e.message}")
                try { writer.write(e.toMessage()) } catch (_: Exception) {}
            } catch (_: ConnectionClosedException) {
            } catch (e: IOException) {
                log("session I/O: ${e.message}")
            } finally {
                if (hostWriter === writer) hostWriter = null
                files.abortAll()
                auth.releaseSession()
                log("host session ended")
            }
        }
    }

    private fun session(reader: FrameReader, writer: FrameWriter) {
        while (true) {
            val m = reader.read()
            when (m.type) {
                MsgType.HEARTBEAT -> writer.write(Messages.heartbeat(m.long("seq"), System.nanoTime() / 1_000_000))
                MsgType.STAGE_ASSIGN -> writer.write(assign(m))
                MsgType.STATE_GET -> writer.write(requireStage(m).state(m.string("kind"), m.long("request_id")))
                MsgType.STATE_PUT -> writer.write(Messages.ack(m.long("request_id"), false, "STATE_PUT is not supported by this device yet; the adapter starts from its checkpoint or from init"))
                MsgType.FILE_BEGIN, MsgType.FILE_CHUNK, MsgType.FILE_END -> files.onMessage(m)?.let { writer.write(it) }
                MsgType.SHUTDOWN -> { stopStage(); return }
                MsgType.ERROR -> { log("host reported ${m.string("code")}: ${m.string("message")}"); return }
                else -> throw ProtocolException(ErrorCode.UNEXPECTED, "${m.type} is not something a host sends to a device" +
                    if (m.type == MsgType.HIDDEN_STATE) "; hidden states go to the stage's data_port (PROTOCOL.md 5.4.1)" else "")
            }
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
        stopStage()
        val runner = try { runners.create(a, filesDir) } catch (e: Exception) {
            return Messages.error(ErrorCode.REJECTED, "cannot load the chunk program: ${e.message}", rid)
        }
        val rt = try {
            StageRuntime(a, runner, checkpointDir, { hostWriter }, stats, listener, bindAddress, log)
        } catch (e: Exception) {
            runner.close()
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
