fn main() {
    eprintln!("rawdisk: not built yet");
    std::process::exit(2);
}
