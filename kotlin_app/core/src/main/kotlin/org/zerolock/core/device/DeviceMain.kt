package org.zerolock.core.device

import org.zerolock.core.ProcStats
import org.zerolock.core.executorch.EtLibrary
import org.zerolock.core.executorch.ExecuTorchBackend
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.RateLimiter
import java.io.File
import java.net.InetAddress
import java.nio.file.Files
import kotlin.system.exitProcess

/**
 * A Kotlin phone on the JVM: the app's core (protocol, links, stage runtime, AdamW, checkpoints)
 * minus its Android layer, serving ZLWP/1 like zl-phone.
 *
 *   java -cp "$(cat kotlin_app/build/classpath.txt)" org.zerolock.core.device.DeviceMain \
 *        [--runtime executorch|affine] [--port 0] [--bind 127.0.0.1] [--token HEX64] [--name NAME]
 *        [--workdir DIR] [--threads N] [--heartbeat-ms N] [--mem-limit SIZE] [--cpu-share F]
 *        [--rate-mbit F] [--link-delay-ms F] [--detach]
 *
 * `--runtime executorch` (the default) runs the pushed chunk (zl-export's .pte + .ptd) through
 * ExecuTorch's C++ runtime (kotlin_app/jni, built by run_tests.sh); `affine` is the stand-in chunk
 * h*(1+a)+b that protocol tests use. `--threads` sizes ExecuTorch's thread pool. `--heartbeat-ms`
 * sends the host a HEARTBEAT that often while a session is open (zl-host starts Kotlin phones with
 * 500, zl-phone's period; default 0: none, the device only answers the host's). `--mem-limit SIZE`
 * (600M, 1.5G: zl-phone's sizes) ends the process with exit 137 once its resident memory passes
 * SIZE, as a phone's low-memory killer would, and is the budget HELLO reports (device/MemoryLimit.kt).
 * `--cpu-share F` only says, in HELLO's `cpu_share`, what the launcher that started this process
 * (zl_mobile.cpu_budget, host/phones/kotlin_phone.py) holds it to; it limits nothing itself.
 * `--rate-mbit F` paces what the stage links send to F Mbit/s (one token bucket for all, 64 KiB
 * pieces) and `--link-delay-ms F` has each frame arriving on them seen F ms later, as zl-phone's.
 *
 * Prints `TOKEN <hex>`, `LISTENING <port>` and a zl-phone-like `NAME: listening on ADDR:PORT`
 * line once it accepts connections, then serves until stdin closes (the parent went away) or,
 * with `--detach`, until it is killed. As with zl-phone, STAGE_ASSIGN opens the stage's data port.
 */
object DeviceMain {
    const val USAGE = "usage: DeviceMain [--runtime executorch|affine] [--port N] [--bind ADDR] [--token HEX64] [--name NAME] " +
        "[--workdir DIR] [--threads N] [--heartbeat-ms N] [--mem-limit SIZE] [--cpu-share F] [--rate-mbit F] [--link-delay-ms F] [--detach]"

    /** What HELLO's runtime_version and the TXT record's `runtime` say, per --runtime. */
    fun runtimeLabel(runtime: String): String = if (runtime == "affine") "kotlin/affine" else "kotlin/executorch"

    @JvmStatic
    fun main(args: Array<String>) {
        try {
            run(args)
        } catch (e: UsageError) {
            System.err.println("DeviceMain: error: ${e.message}")
            exitProcess(2)
        }
    }

    private class UsageError(msg: String) : Exception(msg)

    private fun run(args: Array<String>) {
        var port = 0
        var bind = "127.0.0.1"
        var token: String? = null
        var name = "kotlin-device"
        var dir: File? = null
        var runtime = "executorch"
        var threads = 0
        var detach = false
        var heartbeatMs = 0
        var memLimit: Long? = null
        var cpuShare: Double? = null
        var rateMbit: Double? = null
        var linkDelayMs = 0.0
        var i = 0
        fun value(): String = args.getOrNull(++i) ?: throw UsageError("${args[i - 1]} needs a value")
        fun int(what: String, range: IntRange): Int = value().let { v ->
            v.toIntOrNull()?.takeIf { it in range } ?: throw UsageError("$what must be a whole number in ${range.first}..${range.last}, got '$v'")
        }
        while (i < args.size) {
            when (args[i]) {
                "--port" -> port = int("--port", 0..65535)
                "--bind" -> bind = value()
                "--token" -> token = value()
                "--name" -> name = value()
                "--dir", "--workdir" -> dir = File(value())
                "--runtime" -> runtime = value().also { if (it !in listOf("executorch", "affine")) throw UsageError("--runtime must be executorch or affine, got '$it'") }
                "--threads" -> threads = int("--threads", 1..256)
                "--heartbeat-ms" -> heartbeatMs = int("--heartbeat-ms", 0..60_000)
                "--mem-limit" -> memLimit = value().let { v ->
                    try { MemoryLimit.parseSize(v) } catch (e: IllegalArgumentException) { throw UsageError("--mem-limit: ${e.message}") }
                }
                "--cpu-share" -> cpuShare = value().let { v ->
                    // zl_mobile.cpu_budget.MIN_SHARE: the launcher refuses less
                    v.toDoubleOrNull()?.takeIf { it.isFinite() && it >= 0.1 }
                        ?: throw UsageError("--cpu-share must be a share of one core of at least 0.1 (e.g. 0.5), got '$v'")
                }
                "--rate-mbit" -> rateMbit = value().let { v ->
                    v.toDoubleOrNull()?.takeIf { it.isFinite() && it > 0 } ?: throw UsageError("--rate-mbit must be a number of Mbit/s above 0 (e.g. 20), got '$v'")
                }
                "--link-delay-ms" -> linkDelayMs = value().let { v ->
                    v.toDoubleOrNull()?.takeIf { it.isFinite() && it >= 0 } ?: throw UsageError("--link-delay-ms must be >= 0, got '$v'")
                }
                "--detach" -> detach = true
                "-h", "--help" -> { println(USAGE); return }
                else -> throw UsageError("unknown argument ${args[i]}; $USAGE")
            }
            i++
        }
        val tok = token ?: Handshake.newToken()
        try { Handshake.parseToken(tok) } catch (e: Exception) { throw UsageError("--token: ${e.message}") }
        // watched from here on, before the bridge and the chunk's libraries load: they count too
        val limit = memLimit?.let { MemoryLimit(it, name).start() }
        val root = dir ?: Files.createTempDirectory("zl-device").toFile()
        val runners = if (runtime == "affine") RunnerFactory { _, _ -> AffineChunkRunner() } else {
            // load the bridge now: a phone that cannot run chunks says so at start, not at STAGE_ASSIGN
            val registry = try { EtLibrary.ensureLoaded(threads) } catch (e: IllegalStateException) { throw UsageError(e.message ?: "$e") }
            System.err.println("[device] ExecuTorch: $registry")
            ManifestRunnerFactory { program, weights -> ExecuTorchBackend.load(program, weights) }
        }
        val pss = PssSampler()
        val server = DeviceServer(
            info = DeviceInfo(name, runtimeLabel(runtime), HelloFacts.totalMemoryBytes(), listOf("lora", "replay"),
                extra = HelloFacts.fixed(HelloFacts.cores(), cpuShare), live = { HelloFacts.live(limit) }),
            token = tok,
            filesDir = File(root, "files"),
            checkpointDir = File(root, "checkpoints"),
            runners = runners,
            // PSS from /proc/self/smaps_rollup where Linux has it (else the JVM heap in use); no temperature
            stats = { Pair(pss.read(), null) },
            log = { System.err.println("[device] $it") },
        )
        server.heartbeatPeriodMs = heartbeatMs.toLong()
        server.linkShaping = LinkShaping(rateMbit?.let { RateLimiter(it * 1e6 / 8) },
            if (linkDelayMs > 0) DelayLine(linkDelayMs) { System.err.println("[device] $it") } else null)
        val p = server.start(port, InetAddress.getByName(bind))
        println("TOKEN $tok")
        println("LISTENING $p")
        println("$name: listening on $bind:$p, work dir $root, runtime ${runtimeLabel(runtime)}")
        System.out.flush()
        if (detach) {
            Runtime.getRuntime().addShutdownHook(Thread { server.close() })
            Thread.currentThread().join() // until killed
        }
        // serve until stdin closes (the parent process went away) or we are killed
        try { while (System.`in`.read() >= 0) {} } catch (_: Exception) {}
        server.close()
    }
}

/**
 * PSS read at most every [everyNs] (as zl_mobile's PssSampler): the kernel walks every mapping
 * for smaps_rollup, and a JVM has many, which a tiny chunk's milliseconds-long step would pay.
 */
internal class PssSampler(private val everyNs: Long = 250_000_000L) {
    private var at = 0L
    private var value = 0L

    @Synchronized
    fun read(): Long {
        val now = System.nanoTime()
        if (at == 0L || now - at >= everyNs) {
            value = ProcStats.SELF.pssBytes() ?: (Runtime.getRuntime().totalMemory() - Runtime.getRuntime().freeMemory())
            at = now
        }
        return value
    }
}
