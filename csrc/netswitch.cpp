// dilocox-netswitch: a user-space Ethernet switch that delays every frame it forwards (netem's "delay" where the
// kernel has no netem). dilocox/launch/switch.py builds it and starts it inside the switch namespace of an emulated
// cluster (launch/netns.Cluster with a latency), one AF_PACKET socket per port; the reference it is tested against is
// the kernel bridge it replaces (tests/test_switch.py: same bytes, RTT and rate within 10 % of the settings).
//
//   dilocox-netswitch --delay-us D [--jitter-us J] [--loss P] [--seed S] [--max-queue-bytes B] IFACE...
//
// Each frame received on a port goes to the port that learned its destination MAC (else to every other port) after
// D +- J microseconds (uniform; a port's frames leave in the order they arrived), or is dropped with probability P.
// PACKET_VNET_HDR on receive and send carries the kernel's GSO/checksum header along, so a GSO super-frame of a veth
// is forwarded whole and segmented by the egress device. Prints "ready" once every socket is bound; on SIGTERM or
// SIGINT prints one line per port "port IFACE rx_frames N rx_bytes N tx_frames N tx_bytes N dropped N" and exits 0.
#include <arpa/inet.h>
#include <linux/if_packet.h>
// struct virtio_net_hdr (linux/virtio_net.h, not C++-clean): 10 bytes
#include <net/ethernet.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kVnetHdr = 10;

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

struct Frame {
  uint64_t due_ns;
  std::vector<uint8_t> data;  // virtio_net_hdr + the Ethernet frame
};

struct Port {
  std::string name;
  int fd = -1;
  std::deque<Frame> queue;
  uint64_t last_due = 0, rx_frames = 0, rx_bytes = 0, tx_frames = 0, tx_bytes = 0, dropped = 0;
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "dilocox-netswitch: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

int open_port(const std::string& name) {
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(ETH_P_ALL));
  if (fd < 0) die("socket(AF_PACKET) for " + name + " (needs root)");
  int one = 1;
  if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0) die("PACKET_IGNORE_OUTGOING");
  if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0) die("PACKET_VNET_HDR");
  // a deep socket buffer (FORCE: past net.core.rmem_max, as root): frames wait there, not dropped, while the switch
  // waits for a core on a busy host
  int bufsz = 32 << 20;
  if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &bufsz, sizeof bufsz) < 0)
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufsz, sizeof bufsz);
  if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bufsz, sizeof bufsz) < 0)
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufsz, sizeof bufsz);
  unsigned idx = if_nametoindex(name.c_str());
  if (idx == 0) die("no interface " + name);
  sockaddr_ll sll{};
  sll.sll_family = AF_PACKET;
  sll.sll_protocol = htons(ETH_P_ALL);
  sll.sll_ifindex = int(idx);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sll), sizeof sll) < 0) die("bind " + name);
  packet_mreq mr{};
  mr.mr_ifindex = int(idx);
  mr.mr_type = PACKET_MR_PROMISC;
  setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr);
  return fd;
}

uint64_t mac_key(const uint8_t* m) {
  uint64_t k = 0;
  for (int i = 0; i < 6; ++i) k = (k << 8) | m[i];
  return k;
}

}  // namespace

int main(int argc, char** argv) {
  double delay_us = 0, jitter_us = 0, loss = 0;
  uint64_t seed = 1, max_queue = 256ull << 20;
  std::vector<Port> ports;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "dilocox-netswitch: %s needs a value\n", flag);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--delay-us") delay_us = std::atof(val("--delay-us"));
    else if (a == "--jitter-us") jitter_us = std::atof(val("--jitter-us"));
    else if (a == "--loss") loss = std::atof(val("--loss"));
    else if (a == "--seed") seed = std::strtoull(val("--seed"), nullptr, 10);
    else if (a == "--max-queue-bytes") max_queue = std::strtoull(val("--max-queue-bytes"), nullptr, 10);
    else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "dilocox-netswitch: unknown option %s\n", a.c_str());
      return 2;
    } else {
      ports.push_back(Port{});
      ports.back().name = a;
    }
  }
  if (ports.size() < 2 || delay_us < 0 || jitter_us < 0 || jitter_us > delay_us || loss < 0 || loss >= 1) {
    std::fprintf(stderr,
                 "usage: dilocox-netswitch --delay-us D [--jitter-us J<=D] [--loss 0<=P<1] [--seed S] IFACE IFACE...\n");
    return 2;
  }
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);
  // a real-time priority (root): a frame leaves when it is due even when every core is busy with training (as netem
  // in the kernel's softirq would); the loop sleeps in epoll between frames, so it takes no core of its own
  sched_param sp{};
  sp.sched_priority = 10;
  sched_setscheduler(0, SCHED_FIFO, &sp);
  int ep = epoll_create1(0);
  int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
  if (ep < 0 || tfd < 0) die("epoll/timerfd");
  for (size_t p = 0; p < ports.size(); ++p) {
    ports[p].fd = open_port(ports[p].name);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = p;
    if (epoll_ctl(ep, EPOLL_CTL_ADD, ports[p].fd, &ev) < 0) die("epoll_ctl");
  }
  epoll_event tev{};
  tev.events = EPOLLIN;
  tev.data.u64 = ports.size();
  if (epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &tev) < 0) die("epoll_ctl timer");
  std::printf("ready\n");
  std::fflush(stdout);

  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  std::unordered_map<uint64_t, size_t> fdb;  // MAC -> port
  uint64_t queued = 0, armed = 0;
  std::vector<uint8_t> buf(kVnetHdr + 65536 + 64);
  const size_t hdr = kVnetHdr;
  epoll_event evs[64];

  auto flush_due = [&]() {
    uint64_t t = now_ns();
    for (auto& port : ports) {
      while (!port.queue.empty() && port.queue.front().due_ns <= t) {
        Frame& f = port.queue.front();
        ssize_t n = send(port.fd, f.data.data(), f.data.size(), 0);
        if (n < 0 && (errno == EAGAIN || errno == ENOBUFS)) break;  // the device queue is full: retry on the tick
        if (n < 0) ++port.dropped;
        else {
          ++port.tx_frames;
          port.tx_bytes += f.data.size() - hdr;
        }
        queued -= f.data.size();
        port.queue.pop_front();
      }
    }
  };
  auto arm = [&]() {  // the timer at the earliest due frame (or 50 us from now when a send was refused)
    uint64_t next = UINT64_MAX, t = now_ns();
    for (auto& port : ports)
      if (!port.queue.empty()) next = std::min(next, std::max(port.queue.front().due_ns, t + 50000));
    if (next == armed) return;
    armed = next;
    itimerspec its{};
    if (next != UINT64_MAX) {
      its.it_value.tv_sec = time_t(next / 1000000000ull);
      its.it_value.tv_nsec = long(next % 1000000000ull);
    }
    timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, nullptr);
  };

  while (!g_stop) {
    int n = epoll_wait(ep, evs, 64, 200);
    if (n < 0 && errno != EINTR) die("epoll_wait");
    for (int e = 0; e < n; ++e) {
      size_t in = evs[e].data.u64;
      if (in == ports.size()) {
        uint64_t ticks;
        (void)!read(tfd, &ticks, sizeof ticks);
        armed = 0;
        continue;
      }
      Port& src = ports[in];
      for (int burst = 0; burst < 256; ++burst) {
        ssize_t len = recv(src.fd, buf.data(), buf.size(), MSG_TRUNC);
        if (len < 0) break;
        if (size_t(len) > buf.size() || size_t(len) < hdr + 14) {
          ++src.dropped;
          continue;
        }
        ++src.rx_frames;
        src.rx_bytes += size_t(len) - hdr;
        const uint8_t* eth = buf.data() + hdr;
        fdb[mac_key(eth + 6)] = in;
        std::vector<size_t> outs;
        auto hit = fdb.find(mac_key(eth));
        if (!(eth[0] & 1) && hit != fdb.end()) {
          if (hit->second != in) outs.push_back(hit->second);
        } else {
          for (size_t p = 0; p < ports.size(); ++p)
            if (p != in) outs.push_back(p);
        }
        uint64_t t = now_ns();
        for (size_t o : outs) {
          Port& dst = ports[o];
          if ((loss > 0 && unif(rng) < loss) || queued + size_t(len) > max_queue) {
            ++dst.dropped;
            continue;
          }
          double d = delay_us + (jitter_us > 0 ? (2 * unif(rng) - 1) * jitter_us : 0.0);
          uint64_t due = std::max(t + uint64_t(d * 1000.0), dst.last_due);  // FIFO per port
          dst.last_due = due;
          dst.queue.push_back(Frame{due, std::vector<uint8_t>(buf.begin(), buf.begin() + len)});
          queued += size_t(len);
        }
      }
    }
    flush_due();
    arm();
  }
  for (auto& p : ports)
    std::printf("port %s rx_frames %llu rx_bytes %llu tx_frames %llu tx_bytes %llu dropped %llu\n", p.name.c_str(),
                (unsigned long long)p.rx_frames, (unsigned long long)p.rx_bytes, (unsigned long long)p.tx_frames,
                (unsigned long long)p.tx_bytes, (unsigned long long)p.dropped);
  return 0;
}
