package org.zerolock.core.device

import org.zerolock.core.CreditGate
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
import org.zerolock.core.protocol.hostHandshake
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
 * then serves the session: STAGE_ASSIGN, file pushes, hidden states, credits, state, heartbeat,
 * telemetry. Plain JVM code; the Android TrainingService only starts and stops it.
 *
 * [echoHidden]: with no downstream stage, send h_k back to whoever sent h_{k-1} (interop tests
 * and demos; the sender must return CREDITs for them like a downstream stage would).
 */
class DeviceServer(
    private val info: DeviceInfo,
    token: String,
    private val filesDir: File,
    private val checkpointDir: File,
    private val runners: RunnerFactory,
    private val stats: StatsProvider = StatsProvider { Pair(0L, null) },
    private val listener: StageListener = StageListener {},
    private val echoHidden: Boolean = false,
    private val log: (String) -> Unit = {},
) : AutoCloseable {
    private val auth = DeviceAuth(token, info.name)
    private var server: ServerSocket? = null
    @Volatile private var hostWriter: FrameWriter? = null
    @Volatile var stage: StageRuntime? = null
        private set
    private var upstreamServer: LinkServer? = null
    private val files = FileReceiver(filesDir)
    @Volatile private var closed = false

    val port: Int get() = server?.localPort ?: -1

    /** Bind (port 0 = any free port) and serve in background threads. Returns the bound port. */
    fun start(port: Int = 0, bind: InetAddress? = null): Int {
        val s = ServerSocket()
        s.reuseAddress = true
        s.bind(InetSocketAddress(bind, port))
        server = s
        Thread({ acceptLoop(s) }, "zl-accept").also { it.isDaemon = true; it.start() }
        log("listening on ${s.localSocketAddress}")
        return s.localPort
    }

    private fun acceptLoop(s: ServerSocket) {
        while (!closed) {
            val c = try { s.accept() } catch (e: IOException) { if (closed) return else continue }
            Thread({ serve(c) }, "zl-conn-${c.port}").also { it.isDaemon = true; it.start() }
        }
    }

    private fun serve(sock: Socket) {
        sock.use { c ->
            c.tcpNoDelay = true
            val reader = FrameReader(c.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
            val writer = FrameWriter(c.getOutputStream().buffered())
            c.soTimeout = Handshake.HANDSHAKE_TIMEOUT_MS
            try {
                deviceHandshake(reader, writer, auth, info.hello())
            } catch (e: SocketTimeoutException) {
                try { writer.write(Messages.error(ErrorCode.TIMEOUT, "handshake took longer than 10 s")) } catch (_: Exception) {}
                return
            } catch (e: ProtocolException) {
                log("handshake from ${c.remoteSocketAddress} refused: ${e.message}")
                return
            } catch (e: IOException) {
                return
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
                MsgType.HIDDEN_STATE -> requireStage(m).onHidden(m, writer)
                MsgType.CREDIT -> requireStage(m).let { echoSink?.onCredit(m.long("credits").toInt()) }
                MsgType.REPLAY_REQUEST -> requireStage(m).replay(m.long("from_micro_batch"), m.long("to_micro_batch"))
                MsgType.STATE_GET -> writer.write(requireStage(m).state(m.string("kind"), m.long("request_id")))
                MsgType.STATE_PUT -> writer.write(Messages.ack(m.long("request_id"), false, "STATE_PUT is not supported by this device yet; the adapter starts from its checkpoint or from init"))
                MsgType.FILE_BEGIN, MsgType.FILE_CHUNK, MsgType.FILE_END -> files.onMessage(m)?.let { writer.write(it) }
                MsgType.SHUTDOWN -> { stopStage(); return }
                MsgType.ERROR -> { log("host reported ${m.string("code")}: ${m.string("message")}"); return }
                else -> throw ProtocolException(ErrorCode.UNEXPECTED, "${m.type} is not valid in a host session")
            }
        }
    }

    private fun requireStage(m: Message): StageRuntime =
        stage ?: throw ProtocolException(ErrorCode.UNEXPECTED, "${m.type} before STAGE_ASSIGN; assign a stage first")

    private var echoSink: EchoSink? = null

    @Synchronized
    private fun assign(m: Message): Message {
        val a = StageAssignment(m)
        val rid = m.long("request_id")
        try {
            a.check()
        } catch (e: ProtocolException) {
            return Messages.error(ErrorCode.REJECTED, e.detail, rid)
        }
        stopStage()
        val sink: HiddenSink? = when {
            a.downstream != null -> DownstreamLink(a.downstream, a.downstreamToken!!, "${info.name} stage ${a.stage}", a.inflightDepth)
            echoHidden -> EchoSink({ hostWriter }, a.inflightDepth).also { echoSink = it }
            else -> null
        }
        val runner = try { runners.create(a, filesDir) } catch (e: Exception) {
            sink?.close()
            return Messages.error(ErrorCode.REJECTED, "cannot load the chunk program: ${e.message}", rid)
        }
        val rt = StageRuntime(a, runner, checkpointDir, sink, { hostWriter }, stats, listener)
        stage = rt
        if (a.listenPort != null && a.upstreamToken != null) {
            upstreamServer = LinkServer(a.upstreamToken, info, rt, log).also { it.start(a.listenPort) }
        }
        log("assigned stage ${a.stage}/${a.numStages}, W=${a.windowSize} D=${a.inflightDepth} C=${a.bufferCapacity}, next micro-batch ${rt.trainer.nextMicroBatch}")
        return Messages.ack(rid, true, "stage ${a.stage} ready; next micro-batch ${rt.trainer.nextMicroBatch}")
    }

    @Synchronized
    private fun stopStage() {
        upstreamServer?.close(); upstreamServer = null
        stage?.stop(); stage = null
        echoSink = null
    }

    override fun close() {
        closed = true
        stopStage()
        try { server?.close() } catch (_: IOException) {}
    }
}

/** Echo mode sink: h_k goes back on the host connection, bounded by credits from the host. */
class EchoSink(private val out: () -> FrameWriter?, depth: Int) : HiddenSink {
    private val gate = CreditGate(depth)
    private val lock = Object()

    override fun send(m: Message) {
        synchronized(lock) {
            while (!gate.canSend()) lock.wait(1000)
            gate.onSend()
        }
        (out() ?: throw IOException("host connection gone")).write(m)
    }

    override fun onCredit(n: Int) {
        synchronized(lock) {
            try { gate.onCredit(n) } catch (e: org.zerolock.core.StageError) { throw ProtocolException(ErrorCode.UNEXPECTED, e.message ?: "bad credit") }
            lock.notifyAll()
        }
    }
}

/**
 * The link to the downstream stage: this stage plays "host" (PROTOCOL.md 6) with the link token,
 * sends HIDDEN_STATE within its credits and reads CREDIT frames on a background thread.
 */
class DownstreamLink(private val address: String, private val token: String, private val name: String, depth: Int) : HiddenSink {
    private val gate = CreditGate(depth)
    private val lock = Object()
    private var sock: Socket? = null
    private var writer: FrameWriter? = null

    private fun connect(): FrameWriter {
        writer?.let { return it }
        val host = address.substringBeforeLast(':')
        val port = address.substringAfterLast(':').toInt()
        val s = Socket()
        s.connect(InetSocketAddress(host, port), 10_000)
        s.tcpNoDelay = true
        val r = FrameReader(s.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
        val w = FrameWriter(s.getOutputStream().buffered())
        s.soTimeout = Handshake.HANDSHAKE_TIMEOUT_MS
        hostHandshake(r, w, token, name)
        s.soTimeout = 0
        r.maxFrame = Frames.DEFAULT_MAX_FRAME
        sock = s; writer = w
        Thread({
            try {
                while (true) {
                    val m = r.read()
                    if (m.type == MsgType.CREDIT) onCredit(m.long("credits").toInt())
                }
            } catch (_: Exception) {
            }
        }, "zl-downstream").also { it.isDaemon = true; it.start() }
        return w
    }

    override fun send(m: Message) {
        synchronized(lock) {
            while (!gate.canSend()) lock.wait(1000)
            gate.onSend()
        }
        connect().write(m)
    }

    override fun onCredit(n: Int) {
        synchronized(lock) { gate.onCredit(n); lock.notifyAll() }
    }

    override fun close() { try { sock?.close() } catch (_: IOException) {} }
}

/** Listener for the upstream stage's link (its own token; one upstream at a time). */
class LinkServer(token: String, private val info: DeviceInfo, private val stage: StageRuntime, private val log: (String) -> Unit) : AutoCloseable {
    private val auth = DeviceAuth(token, info.name)
    private var server: ServerSocket? = null

    fun start(port: Int) {
        val s = ServerSocket()
        s.reuseAddress = true
        s.bind(InetSocketAddress(port))
        server = s
        Thread({
            while (!s.isClosed) {
                val c = try { s.accept() } catch (_: IOException) { break }
                Thread({ serve(c) }, "zl-upstream").also { it.isDaemon = true; it.start() }
            }
        }, "zl-link-accept").also { it.isDaemon = true; it.start() }
    }

    private fun serve(sock: Socket) = sock.use { c ->
        val r = FrameReader(c.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
        val w = FrameWriter(c.getOutputStream().buffered())
        c.soTimeout = Handshake.HANDSHAKE_TIMEOUT_MS
        try {
            deviceHandshake(r, w, auth, info.hello())
        } catch (e: Exception) {
            log("upstream link refused: ${e.message}"); return@use
        }
        c.soTimeout = 0
        r.maxFrame = Frames.DEFAULT_MAX_FRAME
        try {
            while (true) {
                val m = r.read()
                when (m.type) {
                    MsgType.HIDDEN_STATE -> stage.onHidden(m, w)
                    MsgType.HEARTBEAT -> w.write(Messages.heartbeat(m.long("seq")))
                    else -> throw ProtocolException(ErrorCode.UNEXPECTED, "${m.type} is not valid on a stage link")
                }
            }
        } catch (e: ProtocolException) {
            try { w.write(e.toMessage()) } catch (_: Exception) {}
        } catch (_: Exception) {
        } finally {
            auth.releaseSession()
        }
    }

    override fun close() { try { server?.close() } catch (_: IOException) {} }
}
