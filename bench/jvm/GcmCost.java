// What the Kotlin phone's record layer costs per byte (bench/sealing.py --runtime kotlin): javax.crypto's
// AES/GCM/NoPadding, as kotlin_app's FrameWriter/FrameReader use it, sealing then opening one frame of N
// bytes with a 16-byte header as AAD. Prints CPU seconds per byte. Run: java bench/jvm/GcmCost.java N
import java.lang.management.ManagementFactory;
import java.nio.ByteBuffer;
import java.security.SecureRandom;
import javax.crypto.Cipher;
import javax.crypto.spec.GCMParameterSpec;
import javax.crypto.spec.SecretKeySpec;

public class GcmCost {
    public static void main(String[] args) throws Exception {
        int n = Math.max(1, Integer.parseInt(args[0]));
        SecureRandom rnd = new SecureRandom();
        byte[] key = new byte[32], header = new byte[16], body = new byte[n];
        rnd.nextBytes(key); rnd.nextBytes(header); rnd.nextBytes(body);
        SecretKeySpec k = new SecretKeySpec(key, "AES");
        Cipher seal = Cipher.getInstance("AES/GCM/NoPadding"), open = Cipher.getInstance("AES/GCM/NoPadding");
        var bean = ManagementFactory.getThreadMXBean();
        long counter = 0, frames = 0, t0 = 0;
        for (int pass = 0; pass < 8; pass++) {  // the first passes warm the JIT up (the phone runs for hours)
            frames = 0;
            t0 = bean.getCurrentThreadCpuTime();
            while (bean.getCurrentThreadCpuTime() - t0 < 300_000_000L) {
                byte[] nonce = ByteBuffer.allocate(12).putInt(0).putLong(counter++).array();
                seal.init(Cipher.ENCRYPT_MODE, k, new GCMParameterSpec(128, nonce));
                seal.updateAAD(header);
                byte[] sealed = seal.doFinal(body);
                open.init(Cipher.DECRYPT_MODE, k, new GCMParameterSpec(128, nonce));
                open.updateAAD(header);
                open.doFinal(sealed);
                frames++;
            }
        }
        System.out.println((bean.getCurrentThreadCpuTime() - t0) / 1e9 / ((double) frames * n));
    }
}
