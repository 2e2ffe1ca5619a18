// The calls Spark's Kafka source and sink make, with the Java kafka-clients they use:
// the driver's AdminClient (createTopics, describeTopics, listOffsets earliest/latest/by time),
// the sink's idempotent acks=all producer, and the executors' consumer (assign, seek, poll,
// position, seekToBeginning, seekToEnd) with a spark-kafka-source group id and no commits.
// Usage: java -cp kafka-clients.jar:slf4j-api.jar:slf4j-nop.jar SparkKafkaCalls.java HOST:PORT TOPIC
// Prints one line "RESULT {json}".

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.*;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.*;
import org.apache.kafka.clients.consumer.*;
import org.apache.kafka.clients.producer.*;
import org.apache.kafka.common.*;
import org.apache.kafka.common.serialization.*;

public class SparkKafkaCalls {
    public static void main(String[] args) throws Exception {
        String bootstrap = args[0];
        String topic = args[1];
        int records = 20;
        StringBuilder out = new StringBuilder("{");
        Properties common = new Properties();
        common.put("bootstrap.servers", bootstrap);
        common.put("request.timeout.ms", "15000");
        common.put("default.api.timeout.ms", "20000");

        try (Admin admin = Admin.create(common)) {
            admin.createTopics(List.of(new NewTopic(topic, 2, (short) 1))).all().get(20, TimeUnit.SECONDS);
            TopicDescription d = admin.describeTopics(List.of(topic)).allTopicNames().get(20, TimeUnit.SECONDS).get(topic);
            out.append("\"partitions\":").append(d.partitions().size());
        }

        Properties p = new Properties();
        p.putAll(common);
        p.put("acks", "all");
        p.put("enable.idempotence", "true");
        p.put("compression.type", "lz4");
        p.put("key.serializer", StringSerializer.class.getName());
        p.put("value.serializer", StringSerializer.class.getName());
        long before = System.currentTimeMillis();
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(p)) {
            for (int i = 0; i < records; i++) {
                ProducerRecord<String, String> r = new ProducerRecord<>(topic, i % 2, "key-" + i, "value-" + i);
                r.headers().add("n", Integer.toString(i).getBytes(StandardCharsets.UTF_8));
                producer.send(r).get(20, TimeUnit.SECONDS);
            }
            producer.flush();
        }

        List<TopicPartition> parts = List.of(new TopicPartition(topic, 0), new TopicPartition(topic, 1));
        try (Admin admin = Admin.create(common)) {
            Map<TopicPartition, OffsetSpec> earliest = new HashMap<>();
            Map<TopicPartition, OffsetSpec> latest = new HashMap<>();
            Map<TopicPartition, OffsetSpec> byTime = new HashMap<>();
            for (TopicPartition tp : parts) {
                earliest.put(tp, OffsetSpec.earliest());
                latest.put(tp, OffsetSpec.latest());
                byTime.put(tp, OffsetSpec.forTimestamp(before - 60_000));
            }
            ListOffsetsOptions opts = new ListOffsetsOptions(IsolationLevel.READ_UNCOMMITTED);
            var e = admin.listOffsets(earliest, opts).all().get(20, TimeUnit.SECONDS);
            var l = admin.listOffsets(latest, opts).all().get(20, TimeUnit.SECONDS);
            var t = admin.listOffsets(byTime, opts).all().get(20, TimeUnit.SECONDS);
            out.append(",\"earliest\":[").append(e.get(parts.get(0)).offset()).append(",").append(e.get(parts.get(1)).offset()).append("]");
            out.append(",\"latest\":[").append(l.get(parts.get(0)).offset()).append(",").append(l.get(parts.get(1)).offset()).append("]");
            out.append(",\"by_time\":[").append(t.get(parts.get(0)).offset()).append(",").append(t.get(parts.get(1)).offset()).append("]");
        }

        Properties c = new Properties();
        c.putAll(common);
        c.put("group.id", "spark-kafka-source-" + UUID.randomUUID() + "-123-executor");
        c.put("enable.auto.commit", "false");
        c.put("auto.offset.reset", "none");
        c.put("key.deserializer", StringDeserializer.class.getName());
        c.put("value.deserializer", StringDeserializer.class.getName());
        try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(c)) {
            consumer.assign(parts);
            consumer.seek(parts.get(0), 3);
            consumer.seek(parts.get(1), 0);
            List<String> got = new ArrayList<>();
            long deadline = System.currentTimeMillis() + 30_000;
            while (got.size() < records - 3 && System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<String, String> r : consumer.poll(Duration.ofMillis(500))) {
                    String n = new String(r.headers().lastHeader("n").value(), StandardCharsets.UTF_8);
                    if (!r.value().equals("value-" + n) || !r.key().equals("key-" + n)) {
                        throw new IllegalStateException("record mismatch at " + r.offset());
                    }
                    got.add(r.partition() + ":" + r.offset());
                }
            }
            out.append(",\"consumed\":").append(got.size());
            out.append(",\"position\":").append(consumer.position(parts.get(0)));
            consumer.seekToBeginning(List.of(parts.get(0)));
            out.append(",\"beginning\":").append(consumer.position(parts.get(0)));
            consumer.seekToEnd(List.of(parts.get(1)));
            out.append(",\"end\":").append(consumer.position(parts.get(1)));
        }
        out.append("}");
        System.out.println("RESULT " + out);
    }
}
