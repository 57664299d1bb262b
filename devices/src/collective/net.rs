//! The connection between the processes of a group that spans processes (one process per
//! rank, started like torchrun starts them): TCP through rank 0, which listens.
//!
//! It carries three things: the *setup token* (rank 0 hands every rank the same 128 bytes, the
//! NCCL unique id for CUDA groups); for every collective, each rank's *arrival* (and, for CPU
//! devices, its input: every rank gets every rank's input and computes its own result, as the
//! in-process host transport does); and *aborts* (a rank whose flush failed tells rank 0, which
//! tells the others at their next exchange, so every rank's read is an `Err` naming it).
//!
//! Frames: kind (1 byte: data or abort), sequence number (u64), rank (u32), length (u64), bytes;
//! little-endian. Reads and writes time out after the group's timeout. This module never
//! interprets a payload and never touches a device.

use crate::DeviceError;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const DATA: u8 = 1;
const ABORT: u8 = 2;

/// Bytes of the setup token.
pub const TOKEN_BYTES: usize = 128;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn err(what: String) -> DeviceError {
    DeviceError::Collective(what)
}

/// This process's end of a group's connections.
pub struct Net {
    rank: u32,
    world: u32,
    /// Rank 0: a stream per other rank (index = rank, 0 unused). Others: the stream to rank 0.
    peers: Mutex<Vec<Option<TcpStream>>>,
}

struct Frame {
    kind: u8,
    seq: u64,
    rank: u32,
    bytes: Vec<u8>,
}

fn write_frame(s: &mut TcpStream, kind: u8, seq: u64, rank: u32, bytes: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 21];
    head[0] = kind;
    head[1..9].copy_from_slice(&seq.to_le_bytes());
    head[9..13].copy_from_slice(&rank.to_le_bytes());
    head[13..21].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(bytes)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Frame> {
    let mut head = [0u8; 21];
    s.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[13..21].try_into().expect("8 bytes")) as usize;
    let mut bytes = vec![0u8; len];
    s.read_exact(&mut bytes)?;
    Ok(Frame {
        kind: head[0],
        seq: u64::from_le_bytes(head[1..9].try_into().expect("8 bytes")),
        rank: u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")),
        bytes,
    })
}

impl Net {
    /// Joins the group of `world` processes as rank `rank`: rank 0 listens on `addr` and
    /// hands `token` to every other rank; the others connect to `addr` (retrying until
    /// `timeout`) and return the token rank 0 sent.
    pub fn connect(
        rank: u32,
        world: u32,
        addr: &str,
        token: [u8; TOKEN_BYTES],
        timeout: Duration,
    ) -> Result<(Net, [u8; TOKEN_BYTES]), DeviceError> {
        if rank >= world {
            return Err(err(format!("rank {rank} is not below the world size {world}")));
        }
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let token = if rank == 0 {
            let listener = TcpListener::bind(addr).map_err(|e| err(format!("rank 0 cannot listen on {addr}: {e}")))?;
            listener.set_nonblocking(true).map_err(|e| err(format!("listening on {addr}: {e}")))?;
            let mut joined = 1;
            while joined < world {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false)
                            .and_then(|_| s.set_read_timeout(Some(timeout)))
                            .map_err(|e| err(e.to_string()))?;
                        let mut r = [0u8; 4];
                        s.read_exact(&mut r).map_err(|e| err(format!("a rank joining on {addr}: {e}")))?;
                        let r = u32::from_le_bytes(r);
                        if r == 0 || r >= world || peers[r as usize].is_some() {
                            return Err(err(format!("a process joined as rank {r}, which is out of range or taken")));
                        }
                        s.write_all(&token).map_err(|e| err(format!("sending the setup token to rank {r}: {e}")))?;
                        peers[r as usize] = Some(s);
                        joined += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            let missing: Vec<String> =
                                (1..world).filter(|&r| peers[r as usize].is_none()).map(|r| r.to_string()).collect();
                            return Err(err(format!(
                                "rank 0 waited {:.0} s on {addr} for rank(s) {} to join",
                                timeout.as_secs_f64(),
                                missing.join(", ")
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(err(format!("rank 0 accepting on {addr}: {e}"))),
                }
            }
            token
        } else {
            let mut s = loop {
                match TcpStream::connect(addr) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(err(format!("rank {rank} could not reach rank 0 at {addr}: {e}")));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            s.set_read_timeout(Some(timeout)).map_err(|e| err(e.to_string()))?;
            s.write_all(&rank.to_le_bytes()).map_err(|e| err(format!("joining rank 0 at {addr}: {e}")))?;
            let mut token = [0u8; TOKEN_BYTES];
            s.read_exact(&mut token).map_err(|e| err(format!("rank {rank} waiting for rank 0's setup token: {e}")))?;
            peers[0] = Some(s);
            token
        };
        for s in peers.iter().flatten() {
            let _ = s.set_nodelay(true);
        }
        Ok((Net { rank, world, peers: Mutex::new(peers) }, token))
    }

    /// How long a read waits for another process.
    pub fn set_timeout(&self, timeout: Duration) {
        for s in lock(&self.peers).iter().flatten() {
            let _ = s.set_read_timeout(Some(timeout));
        }
    }

    /// Collective `seq`: sends this rank's `payload` and returns every rank's, by rank, once
    /// every rank has arrived; an `Err` when a rank aborted, disconnected or did not answer in
    /// time.
    pub fn exchange(&self, seq: u64, payload: &[u8]) -> Result<Vec<Vec<u8>>, DeviceError> {
        let mut peers = lock(&self.peers);
        let io = |who: u32, e: std::io::Error| {
            let what = match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "did not answer in time".to_string(),
                _ => format!("is unreachable ({e})"),
            };
            err(format!("collective #{seq}: rank {who} {what}"))
        };
        let mut parts: Vec<Vec<u8>> = vec![Vec::new(); self.world as usize];
        parts[self.rank as usize] = payload.to_vec();
        if self.rank == 0 {
            for r in 1..self.world {
                let s = peers[r as usize].as_mut().expect("rank 0 holds every peer");
                let f = read_frame(s).map_err(|e| io(r, e))?;
                if f.kind == ABORT {
                    let reason = String::from_utf8_lossy(&f.bytes).into_owned();
                    for (q, s) in peers.iter_mut().enumerate() {
                        if let Some(s) = s.as_mut().filter(|_| q as u32 != r) {
                            let _ = write_frame(s, ABORT, seq, f.rank, reason.as_bytes());
                        }
                    }
                    return Err(err(reason));
                }
                if f.seq != seq || f.rank != r {
                    return Err(err(format!("collective #{seq}: rank {r} sent collective #{} instead", f.seq)));
                }
                parts[r as usize] = f.bytes;
            }
            for r in 1..self.world {
                let s = peers[r as usize].as_mut().expect("rank 0 holds every peer");
                for (q, part) in parts.iter().enumerate() {
                    write_frame(s, DATA, seq, q as u32, part).map_err(|e| io(r, e))?;
                }
            }
        } else {
            let s = peers[0].as_mut().expect("a rank holds its stream to rank 0");
            write_frame(s, DATA, seq, self.rank, payload).map_err(|e| io(0, e))?;
            for q in 0..self.world {
                let f = read_frame(s).map_err(|e| io(0, e))?;
                if f.kind == ABORT {
                    return Err(err(String::from_utf8_lossy(&f.bytes).into_owned()));
                }
                if f.seq != seq || f.rank != q {
                    return Err(err(format!("collective #{seq}: rank 0 relayed collective #{} instead", f.seq)));
                }
                parts[q as usize] = f.bytes;
            }
        }
        Ok(parts)
    }

    /// Tells the other processes that this rank failed (best effort: a process that is gone
    /// is noticed at the next exchange anyway).
    pub fn abort(&self, reason: &str) {
        // A rank that is inside an exchange holds the lock; it fails on its own then.
        let Ok(mut peers) = self.peers.try_lock() else { return };
        for s in peers.iter_mut().flatten() {
            let _ = write_frame(s, ABORT, 0, self.rank, reason.as_bytes());
        }
    }
}
