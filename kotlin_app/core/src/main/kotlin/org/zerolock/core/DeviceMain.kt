package org.zerolock.core

import org.zerolock.core.device.AffineChunkRunner
import org.zerolock.core.device.DeviceInfo
import org.zerolock.core.device.DeviceServer
import org.zerolock.core.device.RunnerFactory
import org.zerolock.core.protocol.Handshake
import java.io.File
import java.net.InetAddress
import java.nio.file.Files

/**
 * A minimal ZeroLock device on the JVM (no ExecuTorch): serves ZLWP/1 with the
 * [AffineChunkRunner] stand-in chunk. Used by tests/test_kotlin_interop.py and for demos.
 *
 *   java -cp "$(cat kotlin_app/build/classpath.txt)" org.zerolock.core.DeviceMain \
 *        [--port 0] [--bind 127.0.0.1] [--token HEX64] [--name NAME] [--dir DIR]
 *
 * Prints `TOKEN <hex>` and `LISTENING <port>` on stdout once it accepts connections, then
 * serves until stdin closes or the process is killed. As with zl-phone, STAGE_ASSIGN opens the
 * stage's data port (ACK `data_port`) for the upstream link / the host's feed.
 */
object DeviceMain {
    @JvmStatic
    fun main(args: Array<String>) {
        var port = 0
        var bind = "127.0.0.1"
        var token: String? = null
        var name = "kotlin-device"
        var dir: File? = null
        var i = 0
        fun value(): String = args.getOrNull(++i) ?: error("${args[i - 1]} needs a value")
        while (i < args.size) {
            when (args[i]) {
                "--port" -> port = value().toInt()
                "--bind" -> bind = value()
                "--token" -> token = value()
                "--name" -> name = value()
                "--dir" -> dir = File(value())
                "-h", "--help" -> { println("usage: DeviceMain [--port N] [--bind ADDR] [--token HEX64] [--name NAME] [--dir DIR]"); return }
                else -> error("unknown argument ${args[i]}")
            }
            i++
        }
        val tok = token ?: Handshake.newToken()
        Handshake.parseToken(tok)
        val root = dir ?: Files.createTempDirectory("zl-device").toFile()
        val server = DeviceServer(
            info = DeviceInfo(name, "kotlin-core (affine stand-in chunk)", Runtime.getRuntime().maxMemory(), listOf("lora", "replay")),
            token = tok,
            filesDir = File(root, "files"),
            checkpointDir = File(root, "checkpoints"),
            runners = RunnerFactory { _, _ -> AffineChunkRunner() },
            // PSS from /proc/self/smaps_rollup where Linux has it (else the JVM heap in use); no temperature
            stats = { Pair(ProcStats.SELF.pssBytes() ?: (Runtime.getRuntime().totalMemory() - Runtime.getRuntime().freeMemory()), null) },
            log = { System.err.println("[device] $it") },
        )
        val p = server.start(port, InetAddress.getByName(bind))
        println("TOKEN $tok")
        println("LISTENING $p")
        System.out.flush()
        // serve until stdin closes (the parent process went away) or we are killed
        try { while (System.`in`.read() >= 0) {} } catch (_: Exception) {}
        server.close()
    }
}
